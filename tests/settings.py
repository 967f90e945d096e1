"""The settings the test suite runs with: the product's own, in development mode as `make run` serves it.

DEBUG is off by default (production); the suite turns it on here so the web and worker processes it
starts behave like a developer's, and the pages' tests see what `make run` shows. Tests of the production
defaults start their own process with DEBUG unset (tests/integration/test_production_settings.py).
Child processes inherit this environment.
"""

import os

os.environ.setdefault("DEBUG", "1")

from project.settings import *
