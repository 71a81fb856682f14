"""A byte pump for tests of emulated hosts: ``recv HOST`` listens on HOST, prints its
port, then for each connection prints the bytes it received and the seconds from the
first byte to the end; ``send HOST PORT BYTES`` sends that many bytes and closes."""

from __future__ import annotations

import socket
import sys
import time


def recv(host: str, connections: int) -> None:
    with socket.socket() as server:
        server.bind((host, 0))
        server.listen(connections)
        print(server.getsockname()[1], flush=True)
        for _ in range(connections):
            conn, _ = server.accept()
            with conn:
                got, first = 0, 0.0
                while chunk := conn.recv(1 << 20):
                    if not got:
                        first = time.perf_counter()
                    got += len(chunk)
                print(got, time.perf_counter() - first, flush=True)


def send(host: str, port: int, nbytes: int, timeout: float) -> None:
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(b"x" * nbytes)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
