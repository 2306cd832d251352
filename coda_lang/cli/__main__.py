"""`python -m coda_lang.cli`: the `coda` command."""

from coda_lang.cli import entry

entry()
