"""Jobs that tests/test_ding.py runs under the DI-engine virtual environment (.ding-venv)."""
