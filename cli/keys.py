"""``paramserver keys generate DIR``: CURVE key pairs for encrypted, authenticated runs;
``paramserver keys replication FILE``: the key a run's replicas seal their messages with.

Only argument handling and display live here; the keys are made by
:func:`paramserver.wire.curve.generate_curve_keys`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from paramserver.errors import ParamServerError

# rich and zmq are imported where a command runs, so that --help answers at
# once (tests/test_cli_startup.py)

__all__ = ["keys"]

log = logging.getLogger(__name__)


EPILOG = """\b
Examples:
  # a server pair, two workers' pairs and an admin pair
  paramserver keys generate keys --client worker0 --client worker1 --admin ops
\b
  # then: servers require CURVE and admit only those clients
  paramserver server --curve-secret-key keys/server.key_secret \\
      --curve-clients-dir keys/authorized_clients --admin-key keys/ops.key
  paramserver worker --servers 127.0.0.1:5600 --curve-key keys/worker0.key_secret \\
      --curve-server-key keys/server.key
\b
  # one key per run for a replicated shard's replicas (--replication-key)
  paramserver keys replication run.key
\b
See docs/reliability.md (security) for what each key allows.
"""


@click.group(epilog=EPILOG, short_help="CURVE keys: encryption and authentication between workers "
                                          "and servers.")
def keys() -> None:
    """CURVE keys (encryption and authentication between workers and servers), and the
    key a shard's replicas seal their messages with."""


@keys.command(epilog="""\b
Examples:
  paramserver keys generate keys
  paramserver keys generate keys --client worker0 --client worker1 --admin ops
  paramserver keys generate keys --client worker2 --force
""")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--client", "clients", multiple=True, metavar="NAME",
              help="Name of a client key pair to make (repeatable; default: one named 'client').")
@click.option("--admin", "admins", multiple=True, metavar="NAME",
              help="Name of an admin key pair to make (repeatable): servers given its public "
                   "key with --admin-key let it SHUTDOWN, CHECKPOINT and report a worker dead.")
@click.option("--force", is_flag=True, help="Replace keys that exist already.")
def generate(directory: Path, clients: tuple[str, ...], admins: tuple[str, ...],
             force: bool) -> None:
    """Write a server key pair and client key pairs into DIRECTORY.

    The server gets server.key_secret (and, with --curve-clients-dir, the
    authorized_clients folder); each worker gets its NAME.key_secret and the
    server's public server.key. An admin key (--admin NAME) stays out of
    authorized_clients: servers take its public NAME.key with --admin-key.
    Secret files are readable by their owner only.
    """
    from rich.table import Table

    from paramserver.cli.progress import cli_console
    from paramserver.wire.curve import generate_curve_keys

    try:
        made = generate_curve_keys(directory, clients or ("client",), admins=admins,
                                   force=force)
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
    console = cli_console()
    table = Table(title=f"CURVE keys in {directory}")
    table.add_column("who")
    table.add_column("public key (share)")
    table.add_column("secret key (keep private)")
    table.add_row("server", str(made.server_public), str(made.server_secret))
    for name, (public, secret) in made.clients.items():
        table.add_row(name, str(public), str(secret))
    for name, (public, secret) in made.admins.items():
        table.add_row(f"{name} (admin)", str(public), str(secret))
    console.print(table)
    first = next(iter(made.clients.values()))[1]
    admin_flags = "".join(f" [bold]--admin-key[/] {public}" for public, _ in made.admins.values())
    console.print(
        "Servers: [bold]--curve-secret-key[/] " f"{made.server_secret}"
        " [bold]--curve-clients-dir[/] " f"{made.authorized_dir}{admin_flags}\n"
        "Workers: [bold]--curve-key[/] " f"{first}"
        " [bold]--curve-server-key[/] " f"{made.server_public}",
        highlight=False,
    )


@keys.command(epilog="""\b
Examples:
  paramserver keys replication run.key
  paramserver server --replicas 1 --replica 1 --port 5611 --replication-key run.key
  paramserver server --replicas 1 --replica 0 --port 5610 --replication-key run.key \\
      --replica-peers 127.0.0.1:5611
""")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace the key if FILE exists.")
def replication(file: Path, force: bool) -> None:
    """Write a new replication key into FILE, readable by you only.

    Give the same FILE to every replica of a run (--replication-key): a
    replica takes replication messages (inputs, keep-alives, snapshots, joins,
    acknowledgements) only when they are sealed with it. `launch` and `run`
    make one per run themselves. Copy it to other hosts as you would a secret
    key (it is one); docs/reliability.md tells what it protects.
    """
    from paramserver.wire.replauth import make_key_file

    try:
        path = make_key_file(file, force=force)
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"replication key written to {path} (mode 600); give every replica of the "
               f"run --replication-key {path}")
