"""``python -m workers worker|submit|status|results|retry|cancel|run``: the same commands as
``specdec-llm``, usable before they are wired into it (``run`` starts its local workers so)."""

import typer

from .cli import register

app = typer.Typer(no_args_is_help=True, help="specdec-llm workers and bulk jobs.")
register(app)

if __name__ == "__main__":
    app()
