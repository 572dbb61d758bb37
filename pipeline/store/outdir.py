"""The output-safety rule every writer goes through: `audit` and the jobs (`check_out`), `eval` (`check_eval_out`),
`report` and `curate` (`check_file_out`). One rule, three shapes of output:

- nothing is written over an input: the memory banks, query sets and LoCoMo files a command reads, the runs it reads
  (`report`, `curate`, `--reuse`), and the inputs those runs' manifests list;
- nothing is written over a file another command wrote, nor into a folder of another kind: a run folder holds only
  what the audit writes there (datasets, manifest, lock, `quarantine/`) and its own `report.html`; an eval folder only
  what `eval` writes there and its `report.html`; an audit into an eval folder, an eval into an audit folder, or any
  output inside either, is refused;
- each refusal is an OutputError: one line, exit 2, before anything is written.
So `meclear audit --out R && meclear report R && meclear audit --out R` resumes (R knows its report), and curation
and eval outputs go beside R, not into it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from pipeline.core.errors import OutputError
from pipeline.core.provenance import sha256_file
from pipeline.store import manifest as manifests
from pipeline.store.lock import LOCK
from pipeline.store.parts import QUARANTINE
from pipeline.store.writer import VERSION_KEY

DATASET_NAMES = ("contexts", "utilities", "attributions", "interactions", "clearances", "errors")
REPORT = "report.html"  # `meclear report RUN` writes it into the folder it reports on; the folder knows it
OWN_FILES = {*DATASET_NAMES, manifests.FILE, LOCK, QUARANTINE, REPORT}
EVAL_FILES = {"cases.parquet", "summary.json", "summary.md", "figure.png", REPORT}


def _is_own(name: str, own: set[str]) -> bool:
    """Names a command writes: its files and its temporary/staging/old siblings."""
    if name in own:
        return True
    if name.startswith(".") and name.endswith((".tmp", ".staging", ".old")):
        return name[1:].split(".", 1)[0] in {n.split(".")[0] for n in own}
    return False


def is_audit_run(path: Path) -> bool:
    return (path / manifests.FILE).is_file()  # an audit writes its manifest before anything else


def is_eval_out(path: Path) -> bool:
    return (path / "summary.json").is_file() and (path / "cases.parquet").is_file()


def _kind(path: Path) -> str | None:
    if is_audit_run(path):
        return "an audit run folder"
    if is_eval_out(path):
        return "an eval output folder"
    return None


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _check_inputs(flag: str, out: Path, inputs: Iterable[str | Path]) -> None:
    """Neither may hold the other: `out` inside an input folder, or an input inside `out` (or equal)."""
    resolved = out.resolve()
    for p in inputs:
        rp = Path(p).resolve()
        if _inside(rp, resolved):
            raise OutputError(f"{flag} {out}: holds the input {p}; give a separate output folder")
        if _inside(resolved, rp):
            raise OutputError(f"{flag} {out}: is inside the input {p}; give a folder outside it")


def _check_not_inside_a_run(flag: str, out: Path) -> None:
    for parent in out.resolve().parents:
        kind = _kind(parent)
        if kind:
            raise OutputError(f"{flag} {out}: is inside {parent}, {kind}; give a folder beside it")


# Kernel pseudo-filesystems: a write there changes kernel state or fails half-way with an errno no user can act on.
PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


def check_real_folder(flag: str, out: Path) -> None:
    """`out` (resolved) is not on a kernel pseudo-filesystem (/proc, /sys, /dev): one line, before anything else."""
    resolved = Path(out).resolve()
    for root in PSEUDO_ROOTS:
        if _inside(resolved, root) and not _inside(resolved, Path("/dev/shm")):  # /dev/shm is a plain tmpfs
            raise OutputError(f"{flag} {out}: is under {root}, a kernel pseudo-filesystem; give a folder on a disk")


def _check_writable(flag: str, out: Path) -> None:
    existing = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {out}: {existing} is not a writable folder")


def _foreign(out: Path, own: set[str], datasets: Iterable[str] = ()) -> list[str]:
    found = sorted(n for n in os.listdir(out) if not _is_own(n, own))
    found += sorted(f"{d}/{n}" for d in datasets if (out / d).is_dir() for n in os.listdir(out / d)
                    if not (n.endswith(".parquet") or (n.startswith(".") and n.endswith(".tmp"))))
    return found


def check_out(out: Path, inputs: Iterable[str | Path]) -> None:
    """An audit's `--out` (a run folder; a rerun into it resumes). Raises OutputError with one line. `inputs`: every
    file and folder the run reads, --reuse folders included."""
    out = Path(out)
    check_real_folder("--out", out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is an existing file; give a folder")
    _check_inputs("--out", out, inputs)
    _check_not_inside_a_run("--out", out)
    if out.is_dir():
        if is_eval_out(out):
            raise OutputError(f"--out {out}: is an eval output folder; give an audit its own folder")
        foreign = _foreign(out, OWN_FILES, DATASET_NAMES)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise OutputError(f"--out {out}: holds files meclear did not write ({foreign[0]!r}{more}); "
                              "give an empty or new folder")
        if manifests.exists(out):
            try:
                manifests.read(out)  # one line when not meclear's, or of another schema version
            except OutputError as exc:
                raise OutputError(f"--out {out}: {exc}") from None
    _check_writable("--out", out)


def check_eval_out(out: Path, inputs: Iterable[str | Path]) -> None:
    """`meclear eval --out`: a folder of its own (never an audit run folder, nor inside one, nor an input)."""
    out = Path(out)
    check_real_folder("--out", out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is an existing file; give a folder")
    _check_inputs("--out", out, inputs)
    _check_not_inside_a_run("--out", out)
    if out.is_dir() and is_audit_run(out):
        raise OutputError(f"--out {out}: is an audit run folder; give eval its own folder")
    _check_writable("--out", out)


def check_file_out(out: Path, what: str, reads: Iterable[str | Path], own_report_of: Path | None = None) -> None:
    """`report --out` / `curate --out`: one file. `what`: 'report' (HTML) or 'curation' (Parquet). `reads`: the run
    folders the command reads (their manifests' inputs are protected too). `own_report_of`: the run whose own
    `report.html` this is allowed to be."""
    out = Path(out)
    check_real_folder("--out", out)
    if out.is_dir():
        raise OutputError(f"--out {out}: is a folder; give the {what} file's path")
    # Paths are compared resolved (absolute, links followed), and existing files also by (device, inode) and by
    # content hash: a rule that held from one working directory and failed from another overwrote a memory bank.
    protected: list[Path] = []
    identities: set[tuple[int, int]] = set()
    hashes: set[str] = set()
    for r in map(Path, reads):
        protected.append(r)
        if manifests.exists(r):
            try:
                m = manifests.read(r)
            except OutputError:
                continue  # the reader reports the bad manifest itself
            protected += m.input_paths(r)
            identities |= m.input_identities
            hashes |= m.input_hashes
    target = out.resolve()
    own = own_report_of is not None and target == (own_report_of / REPORT).resolve()
    for p in protected:
        rp = p.resolve()
        if target == rp or (rp.is_dir() and _inside(target, rp)):
            if own:
                continue
            raise OutputError(f"--out {out}: is {'in ' if target != rp else ''}{p}, which this {what} reads "
                              f"or its run was made from; give a path outside it")
        if rp.exists():
            st = rp.stat()
            identities.add((st.st_dev, st.st_ino))
    if out.is_file():
        st = out.stat()
        if (st.st_dev, st.st_ino) in identities or (hashes and sha256_file(out) in hashes):
            raise OutputError(f"--out {out}: is the same file as an input its run was made from (by device and inode "
                              "or content); give a path outside the inputs")
    for parent in target.parents:
        kind = _kind(parent)
        if kind and not own:
            raise OutputError(f"--out {out}: is inside {parent}, {kind}; give a path beside it")
    if out.exists() and not _written_by(out, what):
        raise OutputError(f"--out {out}: exists and is not a meclear {what}; give a new path")
    _check_writable("--out", out.parent)


def _written_by(path: Path, what: str) -> bool:
    """Whether existing file `path` is a `what` meclear wrote (then it may be replaced)."""
    try:
        if what == "report":
            with open(path, "rb") as fh:
                return fh.read(15) == b"<!DOCTYPE html>"
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)  # curate writes through `writer.write_table_atomic`: versioned metadata
        return VERSION_KEY in (schema.metadata or {}) and {"rank", "memory_id", "harmful_queries"} <= set(schema.names)
    except Exception:  # unreadable or not Parquet: not ours
        return False


def disk_full(exc: OSError) -> str | None:
    """The one line for a write that failed because the disk (or the user's quota) is full, or None for any other
    OSError. Arrow's writers raise OSError without an errno, so their message is read too. Every file reaches its
    final name only once whole (`pipeline.store.writer`), so what stays is whole; a rerun resumes from it."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc) \
            or "Disk quota exceeded" in str(exc):
        where = f" writing {exc.filename}" if exc.filename else ""
        return (f"disk full{where}; free space (or give another --out) and rerun: whole parts already written are "
                "kept and the run resumes")
    return None
