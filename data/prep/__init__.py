"""The ideas ``data/prepare.py`` tells the story of, one module each; standard library only, because the data is
built before the project's requirements are installed."""
