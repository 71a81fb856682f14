"""Atomic per-shard checkpoints: safetensors for tensors, a JSON manifest for the rest.

Layout of a checkpoint directory::

    DIR/shard0/v0000000120.safetensors   weights, optimizer tensors, open sync round
    DIR/shard0/v0000000120.json          manifest: version, clocks, counters, optimizer
                                         and scheduler metadata, policy state, plan
    DIR/shard0/LATEST                    {"name": "v0000000120", ...}
    DIR/shard1/...

Each file is written to a temporary name, fsynced and renamed; the directory
is fsynced; LATEST moves last, the same way. A process killed at any point
leaves the previous checkpoint whole and LATEST pointing at it. A checkpoint
never overwrites the files LATEST names: a second save at the same version gets
a new name (``v0000000120-1``). Pruning keeps the checkpoint LATEST names and
removes leftovers of a write that never reached LATEST. Nothing is pickled.

The write goes through the named steps of :data:`WRITE_STEPS`; a callable set
with :func:`set_write_hook` is told of each as it completes, which lets tests
kill the writer between any two of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import load_file, save_file

from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ParamServerError
from paramserver.sparse.shard import owned_rows

__all__ = [
    "CHECKPOINT_FORMAT",
    "WRITE_STEPS",
    "CheckpointDirInUse",
    "CheckpointError",
    "earlier_run",
    "export_model",
    "inspect_checkpoint",
    "latest_path",
    "load_shard",
    "move_aside",
    "position",
    "resume_point",
    "save_shard",
    "set_write_hook",
    "supersede",
]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


class CheckpointError(ParamServerError):
    """A checkpoint is missing, incomplete or does not match this run."""


class CheckpointDirInUse(CheckpointError):
    """The checkpoint directory holds an earlier run of the shard, neither resumed nor
    moved aside (``--fresh``)."""


#: the steps of :func:`save_shard`, in the order they complete
WRITE_STEPS = (
    "tensors_written", "tensors_synced", "tensors_renamed",
    "manifest_written", "manifest_synced", "manifest_renamed",
    "dir_synced",
    "latest_written", "latest_synced", "latest_renamed",
    "latest_dir_synced",
    "pruned",
)
WriteHook = Callable[[str, Path], None]
_write_hook: WriteHook | None = None
_NAME = re.compile(r"^v(\d{10})(?:-(\d+))?$")


def set_write_hook(hook: WriteHook | None) -> WriteHook | None:
    """Call ``hook(step, path)`` after each step of a checkpoint write; returns the
    previous hook. For fault injection and tracing; None removes it."""
    global _write_hook
    previous, _write_hook = _write_hook, hook
    return previous


def _step(name: str, path: Path) -> None:
    if _write_hook is not None:
        _write_hook(name, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Any, label: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    _step(f"{label}_written", tmp)
    with tmp.open("rb+") as fh:
        os.fsync(fh.fileno())
    _step(f"{label}_synced", tmp)
    os.replace(tmp, path)
    _step(f"{label}_renamed", path)


def _write_json_atomic(path: Path, data: Any, label: str) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True)),
                  label)


def _order(name: str) -> tuple[int, int]:
    """Sort key of a checkpoint name: (version, how many saves at that version before)."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (-1, -1)


def _free_name(folder: Path, version: int) -> str:
    """``v<version>``, or with a suffix when that name is taken (never overwrite a checkpoint
    LATEST may name)."""
    base = f"v{version:010d}"
    name, n = base, 0
    while (folder / f"{name}.json").exists() or (folder / f"{name}.safetensors").exists():
        n += 1
        name = f"{base}-{n}"
    return name


def save_shard(directory: str | Path, shard: int, tensors: Mapping[str, torch.Tensor],
               meta: Mapping[str, Any], *, keep: int = 2) -> Path:
    """Write one shard's checkpoint atomically and return the manifest's path."""
    folder = Path(directory) / f"shard{shard}"
    folder.mkdir(parents=True, exist_ok=True)
    version = int(meta["version"])
    name = _free_name(folder, version)
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    tensor_path = folder / f"{name}.safetensors"
    _write_atomic(tensor_path, lambda tmp: save_file(contiguous, str(tmp)), "tensors")
    manifest = {
        **meta,
        "format": CHECKPOINT_FORMAT,
        "created": time.time(),
        "tensors_file": tensor_path.name,
        "tensors_bytes": tensor_path.stat().st_size,
    }
    manifest_path = folder / f"{name}.json"
    _write_json_atomic(manifest_path, manifest, "manifest")
    _fsync_dir(folder)  # both renames are durable before LATEST can name them
    _step("dir_synced", folder)
    _write_json_atomic(folder / "LATEST", {"name": name, "version": version,
                                           "created": manifest["created"]}, "latest")
    _fsync_dir(folder)
    _step("latest_dir_synced", folder)
    _prune(folder, name, keep)
    _step("pruned", folder)
    log.info("shard %d: checkpoint at version %d in %s", shard, version, folder)
    return manifest_path


def _prune(folder: Path, latest: str, keep: int) -> None:
    """Keep ``latest`` and the ``keep - 1`` complete checkpoints before it (all of them if
    ``keep <= 0``); remove the rest, files of writes killed before they reached LATEST,
    and their temporary files."""
    names = {p.name.split(".", 1)[0] for p in folder.glob("v*.*")}
    complete = sorted((n for n in names if _order(n) < _order(latest)
                       and (folder / f"{n}.json").exists()
                       and (folder / f"{n}.safetensors").exists()), key=_order)
    kept = {latest, *(complete[-(keep - 1):] if keep > 1 else complete if keep <= 0 else [])}
    # a sync shard's newest checkpoints at its last two closed rounds stay as well: in a
    # sync run the shards stand at most one round apart, so one that was stopped a
    # round behind holds one of them, and the run resumes from that (resume_point)
    kept.update(_between_rounds(folder, [*complete, latest])[-2:])
    for stale in names - kept:
        for suffix in (".json", ".safetensors"):
            (folder / f"{stale}{suffix}").unlink(missing_ok=True)
    for tmp in folder.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def _manifest(folder: Path, name: str) -> dict[str, Any] | None:
    """A checkpoint's manifest, None if it is gone or unreadable (a reader never
    fails on what another process prunes or moves meanwhile)."""
    try:
        meta = json.loads((folder / f"{name}.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def _sync(meta: Mapping[str, Any]) -> bool:
    return str(meta.get("mode", "")).startswith("sync")


def position(meta: Mapping[str, Any]) -> tuple[int, tuple[int, ...], bool] | None:
    """Where a sync shard's checkpoint stands: (rounds closed, the workers in the open
    round, whether that round is void); None for another mode, or a checkpoint from
    before rounds were counted. Checkpoints of a sync run's shards resume together
    only at one position: each worker's push then either reached every shard or none."""
    if not _sync(meta) or type(meta.get("rounds_closed")) is not int:
        return None
    members = meta.get("round", [])
    if not isinstance(members, list):
        return None
    return (meta["rounds_closed"], tuple(sorted(members)), bool(meta.get("round_void")))


def _between_rounds(folder: Path, names: list[str]) -> list[str]:
    """Of ``names`` (oldest first), the newest at each closed round, where the shard
    stood between rounds: oldest first."""
    at: dict[int, str] = {}
    for name in names:
        meta = _manifest(folder, name)
        pos = position(meta) if meta is not None else None
        if pos is not None and not pos[1] and not pos[2]:
            at[pos[0]] = name
    return [at[r] for r in sorted(at)]


def _complete(folder: Path) -> list[str]:
    """The names of a shard's complete checkpoints, oldest first."""
    names = {p.name.split(".", 1)[0] for p in folder.glob("v*.json")}
    return sorted((n for n in names if _NAME.match(n)
                   and (folder / f"{n}.safetensors").exists()), key=_order)


class ResumePoint(TypedDict):
    """Which checkpoint each shard resumes from (:func:`resume_point`)."""

    names: dict[int, str]  # shard -> checkpoint name
    versions: dict[int, int]
    round: int | None  # the sync round they stand at (None: not a sync run)
    consistent: bool  # every shard's LATEST stands at the same round
    note: str  # why not, in words ("" when consistent)


def resume_point(directory: str | Path) -> ResumePoint:
    """Which checkpoint each shard in ``directory`` resumes from.

    A shard checkpoints on its own, so a sync run stopped between two shards' steps
    (SIGTERM, a kill) leaves them at different rounds: shard 0 at round 104, shard 1
    at 103 with a push in its open round. Such shards must not resume together. The
    set is consistent when every shard's latest checkpoint stands at the same
    position (:func:`position`); else each shard resumes from its newest checkpoint
    at the newest position all of them hold (kept by pruning: the shards of a sync
    run stand at most one round apart). Raised (:class:`CheckpointError`) when there
    is none. Other modes (and checkpoints from before rounds were counted): every
    shard's latest."""
    root = Path(directory)
    shards = _shards(root)
    latest = {s: _latest(root / f"shard{s}")["name"] for s in shards}
    metas = {s: _manifest(root / f"shard{s}", n) for s, n in latest.items()}
    points = {s: position(m) if m is not None else None for s, m in metas.items()}
    versions = {s: int(m["version"]) if m and type(m.get("version")) is int else -1
                for s, m in metas.items()}
    if any(p is None for p in points.values()) or len(set(points.values())) == 1:
        first = next(iter(points.values()))
        return ResumePoint(names=latest, versions=versions,
                           round=None if first is None else first[0], consistent=True,
                           note="")
    held: dict[int, dict[tuple[int, tuple[int, ...], bool], tuple[str, int]]] = {}
    for s in shards:
        folder = root / f"shard{s}"
        held[s] = {}
        for name in _complete(folder):
            meta = _manifest(folder, name)
            pos = position(meta) if meta is not None else None
            if meta is not None and pos is not None:
                held[s][pos] = (name, int(meta["version"]))
    common = set.intersection(*(set(h) for h in held.values()))
    note = "the shards stand at different sync rounds: " + ", ".join(
        f"shard {s} at round {p[0]}" + (f" with worker(s) {list(p[1])} in the open round"
                                        if p[1] else "") + (" (void)" if p[2] else "")
        for s, p in points.items() if p is not None)
    if not common:
        raise CheckpointError(f"{note}; no round is held by every shard, so they cannot "
                              f"resume together")
    best = max(common, key=lambda p: (p[0], len(p[1])))
    return ResumePoint(names={s: held[s][best][0] for s in shards},
                       versions={s: held[s][best][1] for s in shards},
                       round=best[0], consistent=False,
                       note=f"{note}; resuming all from round {best[0]}, which every "
                            "shard holds")


def supersede(directory: str | Path, shard: int, name: str) -> Path | None:
    """Make ``name`` this shard's LATEST again, and move the checkpoints after it (a
    timeline the resumed run leaves) to ``shardN/superseded-<time>/``, not deleted;
    returns where (None: nothing came after it)."""
    folder = Path(directory) / f"shard{shard}"
    later = [p for p in folder.glob("v*.*")
             if _NAME.match(p.name.split(".", 1)[0])
             and _order(p.name.split(".", 1)[0]) > _order(name)]
    meta = _manifest(folder, name) or {}
    # LATEST first: a reader in between sees the chosen one, never a missing one
    _write_json_atomic(folder / "LATEST", {"name": name, "version": meta.get("version"),
                                           "created": meta.get("created")}, "latest")
    _fsync_dir(folder)
    if not later:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target, n = folder / f"superseded-{stamp}", 0
    while target.exists():
        n += 1
        target = folder / f"superseded-{stamp}-{n}"
    target.mkdir()
    for path in later:
        os.rename(path, target / path.name)
    _fsync_dir(folder)
    return target


class Latest(TypedDict, total=False):
    """A shard folder's LATEST file: the checkpoint it names (checked: a name, never
    a path), and that checkpoint's version and time (as written; older files may
    lack them)."""

    name: str
    version: int
    created: float


def _latest(folder: Path) -> Latest:
    try:
        latest = json.loads((folder / "LATEST").read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"no checkpoint in {folder} (LATEST is missing)") from exc
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {folder / 'LATEST'}: {exc}") from exc
    name = latest.get("name") if isinstance(latest, dict) else None
    # a name, never a path: LATEST must not point outside its folder
    if not isinstance(name, str) or not _NAME.match(name):
        raise CheckpointError(f"{folder / 'LATEST'} does not name a checkpoint "
                              f"(want {{\"name\": \"v0000000120\"}}, got {str(latest)[:80]})")
    out = Latest(name=name)
    version, created = latest.get("version"), latest.get("created")
    if type(version) is int:
        out["version"] = version
    if isinstance(created, int | float) and not isinstance(created, bool):
        out["created"] = float(created)
    return out


def latest_path(directory: str | Path, shard: int) -> Path:
    """The latest checkpoint of one shard, as ``DIR/shardN/vNNNNNNNNNN`` (its manifest
    is that with ``.json``): where errors about its contents point."""
    folder = Path(directory) / f"shard{shard}"
    return folder / _latest(folder)["name"]


def earlier_run(directory: str | Path, shard: int) -> str | None:
    """What an earlier run left of one shard's checkpoints in ``directory``, in words
    ("version 120", "files without LATEST"); None: nothing."""
    folder = Path(directory) / f"shard{shard}"
    if not folder.is_dir() and not folder.is_symlink():
        return None
    try:
        return f"version {_latest(folder).get('version', '?')}"
    except CheckpointError:
        pass
    names = [p.name for p in folder.glob("v*") if _NAME.match(p.name.split(".", 1)[0])]
    return f"{len(names)} checkpoint file(s) without a usable LATEST" if names else None


def move_aside(directory: str | Path, shard: int) -> Path:
    """Rename one shard's checkpoint folder to ``shardN.before-<time>`` (a name no
    checkpoint reader takes for a shard) and return where it went."""
    folder = Path(directory) / f"shard{shard}"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target, n = folder.with_name(f"shard{shard}.before-{stamp}"), 0
    while target.exists():
        n += 1
        target = folder.with_name(f"shard{shard}.before-{stamp}-{n}")
    os.rename(folder, target)
    _fsync_dir(folder.parent)
    return target


def _regular(path: Path) -> None:
    """A checkpoint's files are plain files of its folder: a symlink could make a
    resume read (and pruning delete) something else."""
    try:
        st = path.lstat()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is {'a symlink' if path.is_symlink() else 'not a file'}"
                              "; a checkpoint's files must be plain files")


def load_shard(directory: str | Path, shard: int, name: str | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The latest complete checkpoint of one shard (or the one called ``name``, as
    :func:`resume_point` picks it): (tensors, manifest). Refused
    (:class:`CheckpointError`) if a file is a symlink, or the manifest's format, name
    or size of the tensors file is not what was written; what the tensors and fields
    hold is checked against the shard when it loads them (paramserver/core/snapshot.py)."""
    folder = Path(directory) / f"shard{shard}"
    if folder.is_symlink():
        raise CheckpointError(f"{folder} is a symlink; a checkpoint's folder must not be")
    _regular(folder / "LATEST")
    if name is None:
        name = _latest(folder)["name"]
    elif not _NAME.match(name):
        raise CheckpointError(f"{name!r} does not name a checkpoint")
    manifest, tensors_path = folder / f"{name}.json", folder / f"{name}.safetensors"
    _regular(manifest)
    _regular(tensors_path)
    try:
        meta = json.loads(manifest.read_text())
    except Exception as exc:  # json raises assorted types
        raise CheckpointError(f"checkpoint {manifest} is unreadable: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{manifest} is not a JSON object")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{manifest}: field 'format': format {meta.get('format')!r}, "
                              f"this version reads {CHECKPOINT_FORMAT}")
    if meta.get("tensors_file") != tensors_path.name:
        raise CheckpointError(f"{manifest}: field 'tensors_file' is "
                              f"{str(meta.get('tensors_file'))[:80]!r}, want {tensors_path.name!r}")
    size = tensors_path.stat().st_size
    if meta.get("tensors_bytes") != size:
        raise CheckpointError(f"checkpoint {tensors_path} is unreadable: it holds {size} "
                              f"bytes, field 'tensors_bytes' of {manifest.name} says "
                              f"{str(meta.get('tensors_bytes'))[:40]}")
    try:
        tensors = load_file(str(tensors_path))
    except Exception as exc:  # safetensors raises assorted types
        raise CheckpointError(f"checkpoint {tensors_path} is unreadable: {exc}") from exc
    return tensors, meta


def _shards(directory: Path) -> list[int]:
    shards = sorted(int(p.name[5:]) for p in directory.glob("shard*")
                    if p.name[5:].isdigit() and (p / "LATEST").exists())
    if not shards:
        raise CheckpointError(f"{directory} holds no shard checkpoints (shard*/LATEST)")
    return shards


def inspect_checkpoint(directory: str | Path) -> dict[str, Any]:
    """A summary of every shard's latest checkpoint, and whether they form a whole."""
    root = Path(directory)
    shards = []
    plan_hashes = set()
    num_shards = None
    for shard in _shards(root):
        folder = root / f"shard{shard}"
        name = _latest(folder)["name"]
        meta = json.loads((folder / f"{name}.json").read_text())
        plan_hashes.add(meta.get("plan_hash"))
        num_shards = meta.get("plan", {}).get("num_shards", num_shards)
        shards.append({
            "shard": shard,
            "name": name,
            "version": meta["version"],
            "mode": meta.get("mode"),
            "round": meta.get("rounds_closed"),
            "open_round": meta.get("round") or [],
            "created": meta.get("created"),
            "bytes": meta.get("tensors_bytes"),
            "plan_hash": meta.get("plan_hash"),
            "workers": {w: {"clock": s["clock"], "applied": s["applied"],
                            "rejected": sum(s["rejected"].values())}
                        for w, s in meta.get("workers", {}).items()},
            "optimizer": meta.get("optimizer_name"),
            "policy": meta.get("policy", {}).get("name"),
        })
    present = {s["shard"] for s in shards}
    missing = sorted(set(range(num_shards or 0)) - present)
    try:
        point: ResumePoint | None = resume_point(root)
        note = point["note"] if point is not None else ""
    except CheckpointError as exc:
        point, note = None, str(exc)
    consistent = point is not None and point["consistent"]
    return {
        "directory": str(root),
        "num_shards": num_shards,
        "shards": shards,
        "missing_shards": missing,
        # a whole model: every shard, one plan, and (sync) one round
        "complete": not missing and len(plan_hashes) == 1 and consistent,
        "consistent": consistent,
        "note": note,
        # what --resume and export take (None: nothing resumable)
        "resume": None if point is None else {
            "round": point["round"], "names": {str(k): v for k, v in point["names"].items()},
            "versions": [point["versions"][s["shard"]] for s in shards]},
        "versions": [s["version"] for s in shards],
    }


def export_model(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Assemble every shard's latest weights into one state_dict file (safetensors).

    Load it with ``model.load_state_dict(safetensors.torch.load_file(out))``.
    Only parameters live on the servers; a model's buffers (e.g. batch-norm
    statistics) are not part of it. A sparse table (ShardedEmbedding) is exported
    whole as ``<module>.weight``: it loads into a model with ``nn.Embedding`` there.
    """
    info = inspect_checkpoint(directory)
    if info["missing_shards"]:
        raise CheckpointError(f"cannot export: shard(s) {info['missing_shards']} have no "
                              f"checkpoint in {directory}")
    if info["resume"] is None:
        raise CheckpointError(f"cannot export: {info['note']}")
    names = {int(k): v for k, v in info["resume"]["names"].items()}
    if len({s["plan_hash"] for s in info["shards"]}) != 1:
        raise CheckpointError("cannot export: the shards' checkpoints come from different plans")
    first = load_shard(directory, info["shards"][0]["shard"], names[info["shards"][0]["shard"]])[1]
    try:
        plan = ShardPlan.from_description(first["plan"])
    except (ConfigError, KeyError) as exc:
        raise CheckpointError(f"checkpoint manifest holds no usable plan: {exc}") from exc
    full = {p.name: torch.zeros(p.shape, dtype=p.torch_dtype) for p in plan.params}
    # a sparse table's rows, each shard's in ascending id order, go under nn.Embedding's name
    tables = {t.name: torch.zeros(t.rows, t.dim, dtype=t.torch_dtype) for t in plan.sparse}
    for s in info["shards"]:
        tensors, _ = load_shard(directory, s["shard"], names[s["shard"]])
        plan.assemble_into(full, {k[len("param/"):]: v for k, v in tensors.items()
                                  if k.startswith("param/")})
        for name, table in tables.items():
            rows = tensors.get(f"sparse/{name}/weight")
            ids = owned_rows(table.shape[0], plan.num_shards, s["shard"])
            if rows is None or rows.shape != (len(ids), table.shape[1]):
                raise CheckpointError(f"cannot export: shard {s['shard']}'s checkpoint lacks "
                                      f"the rows of table {name!r}")
            table[ids] = rows
    full.update({f"{name}.weight": table for name, table in tables.items()})
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(target, lambda tmp: save_file(full, str(tmp)), "export")
    return {"path": str(target), "parameters": len(full),
            "versions": info["resume"]["versions"]}
