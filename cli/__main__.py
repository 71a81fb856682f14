"""``python -m cli``: the same as the ``paramserver`` console script (torchrun's ``-m cli``)."""

from cli.main import main

main(prog_name="paramserver")
