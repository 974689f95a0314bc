"""Adapters that run other frameworks' environments unchanged as clotho environments; each imports
its framework, so it loads only in that framework's own virtual environment (.venv-env-NAME)."""
