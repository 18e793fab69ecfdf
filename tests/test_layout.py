"""The layout of the house, checked against the real files: the story at the root, the plumbing in one package, and
imports that point down (stages and commands -> plumbing -> the model and the tokenizer), with no circle."""

import ast

from conftest import REPO_ROOT

STAGES = {"0-PRETRAIN", "1-SFT", "2-RM", "3-PPO", "3-DPO", "3-GRPO"}
COMMANDS = {"generate", "serve", "pipeline", "load_weight"}
BELOW = {"gpt_model", "gpt_fast", "lora", "chinese_tokenizer"}  # what the package may import from the root
MAX_ROOT_FILES = 14


def module_files(root=REPO_ROOT) -> dict:
    """{module name: path} of the root's .py files ("gpt_model", "3-PPO") and the package's ("plumbing.cli")."""
    files = {p.stem: p for p in root.glob("*.py")}
    files.update({f"plumbing.{p.stem}": p for p in (root / "plumbing").glob("*.py") if p.stem != "__init__"})
    return files


def imported_modules(path, known) -> set:
    """The modules of ``known`` that the file imports anywhere (also inside functions): ``from plumbing.x import y``
    and ``from plumbing import x`` give "plumbing.x", ``import gpt_model`` gives "gpt_model"."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found & set(known)


def import_graph(root=REPO_ROOT) -> dict:
    """{module: the project modules it imports} over the root and the package."""
    files = module_files(root)
    return {name: imported_modules(path, files) - {name} for name, path in files.items()}


def find_cycle(graph: dict) -> list | None:
    """One import circle as a list of modules (first == last), or None; depth-first search."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_by_hand():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]


def test_import_reader_sees_every_form(tmp_path):
    """A lazy import inside a function counts, and so does each form of importing a package module."""
    (tmp_path / "plumbing").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "plumbing" / f"{name}.py").write_text("", encoding="utf-8")
    (tmp_path / "gpt_model.py").write_text("", encoding="utf-8")
    (tmp_path / "cmd.py").write_text("from plumbing import a\nimport gpt_model\n\ndef f():\n"
                                     "    from plumbing.b import x\n", encoding="utf-8")
    (tmp_path / "plumbing" / "c.py").write_text("import cmd\n", encoding="utf-8")
    graph = import_graph(tmp_path)
    assert graph["cmd"] == {"plumbing.a", "plumbing.b", "gpt_model"}
    assert graph["plumbing.c"] == {"cmd"}  # the package importing a command: what the test below refuses
    (tmp_path / "plumbing" / "a.py").write_text("from plumbing import c\n", encoding="utf-8")
    assert find_cycle(import_graph(tmp_path)) == ["cmd", "plumbing.a", "plumbing.c", "cmd"]


def test_the_root_holds_the_story_and_the_commands_only():
    root = {p.stem for p in REPO_ROOT.glob("*.py")}
    assert root == STAGES | COMMANDS | BELOW, f"other files at the root: {sorted(root - STAGES - COMMANDS - BELOW)}"
    assert len(root) <= MAX_ROOT_FILES


def test_the_package_imports_no_stage_and_no_command():
    graph = import_graph()
    assert "plumbing.training" in graph["3-PPO"]  # the graph really was read
    for name, imports in graph.items():
        if name.startswith("plumbing."):
            wrong = {m for m in imports if not m.startswith("plumbing.") and m not in BELOW}
            assert not wrong, f"{name} imports {sorted(wrong)}: the package may import only itself, {sorted(BELOW)}"


def test_no_command_or_stage_imports_another():
    graph = import_graph()
    for name in STAGES | COMMANDS:
        wrong = graph[name] & (STAGES | COMMANDS)
        assert not wrong, f"{name} imports {sorted(wrong)}: a command runs another (load_stage), never imports it"


def test_the_model_and_the_tokenizer_sit_below_everything():
    graph = import_graph()
    assert graph["gpt_model"] == set()  # the lesson: it never imports its speed work
    assert graph["gpt_fast"] == {"gpt_model"}  # the speed work sits on the lesson alone
    assert graph["lora"] == {"gpt_model", "gpt_fast"}  # the adapters sit on the model and know nothing else of ours
    assert graph["chinese_tokenizer"] == set()


def test_no_module_imports_another_in_a_circle():
    assert find_cycle(import_graph()) is None


def project_names_in_loop(source: str, objects=("stage", "online", "held_out", "schedule")) -> set:
    """The project names one iteration of ``main``'s ``for step in stage.steps():`` loop uses, in the loop's own
    lines: each attribute of the stage's plumbing objects (``stage.log``, ``online.score``: ``objects``) and each
    name imported from a project module (``lr_at``), the loop's ``stage.steps`` among them."""
    tree = ast.parse(source)
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                and node.module.split(".")[0] in {"plumbing", *BELOW} for a in node.names}
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For) and isinstance(n.iter, ast.Call)
                and isinstance(n.iter.func, ast.Attribute) and n.iter.func.attr == "steps")
    names = set()
    for node in ast.walk(loop):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in objects:
            names.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in imported:
            names.add(node.id)
    return names


def test_project_name_counter_by_hand():
    source = ("from plumbing.optimizers import lr_at\nfrom plumbing.x import Online\nimport torch\n"
              "def main():\n    online = Online()\n    for step in stage.steps():\n        lr = lr_at(step)\n"
              "        data = online.rollout(step)\n        torch.save(data)\n        stage.log(online.rollout(lr))\n")
    assert project_names_in_loop(source) == {"stage.steps", "lr_at", "online.rollout", "stage.log"}


def test_one_grpo_iteration_reads_as_its_steps():
    """GRPO's loop calls at most 10 project names from outside 3-GRPO.py (it called 18 when the reward was computed
    inside the sampler and the held-out check was a base class of hooks): sample, score, advantages, update, log."""
    names = project_names_in_loop((REPO_ROOT / "3-GRPO.py").read_text(encoding="utf-8"))
    assert {"online.rollout", "online.score"} <= names and len(names) <= 10, sorted(names)
