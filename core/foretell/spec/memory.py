"""What the draft-length policy learned, kept from one ``foretell run`` process to the next.

A library or a server keeps its speculator, and with it the policy, across requests; each
``foretell run`` is a new process whose one request paid for learning what the last run
already knew (docs/decisions.md, item 16). So ``run`` recalls the policy's state
(:meth:`DraftLengthPolicy.state`: acceptance per draft position and round costs in plain
steps, never seconds as estimates) at its start and stores it at its end, one small JSON
file per key under ``cache_home()/draft-policy/`` (``$FORETELL_POLICY_MEMORY_DIR``). The key is what makes a state valid: the
drafter (kind, draft identity, options, most tokens a round, acceptance rule), the target
(the fingerprint the prefix cache names a model by), the device, greedy or sampled decoding
(acceptance differs between the two rules), and the state's format.

Nothing here is ever an error: a missing, unreadable, oversized, special, foreign or corrupt
file is ignored with one debug line, and so is a file that cannot be written. Writes go to
a temporary file renamed over the old one, so concurrent runs leave one of their states
whole (the last to finish), never a mixture; a killed writer's temporary file is removed by
a later store once it is an hour old.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from foretell.spec.policy import STATE_FORMAT, DraftLengthPolicy

log = logging.getLogger("foretell.spec")

#: The directory under :func:`foretell.platform.cache_home` holding the states.
DIRECTORY = "draft-policy"
#: A state file is a few hundred bytes; anything past this is not one, and is not read.
MAX_BYTES = 64 * 1024


#: Names another directory for the states (a sandbox, a test suite: runs then share
#: nothing with the user's).
DIRECTORY_ENV = "FORETELL_POLICY_MEMORY_DIR"


def default_root() -> Path:
    """``$FORETELL_POLICY_MEMORY_DIR`` if set, else ``cache_home()/draft-policy``."""
    from foretell.platform import cache_home

    return Path(os.environ.get(DIRECTORY_ENV) or cache_home() / DIRECTORY)


def state_path(key: dict[str, Any], root: Path | None = None) -> Path:
    """The file holding ``key``'s state."""
    digest = hashlib.blake2b(_canonical(key).encode(), digest_size=16).hexdigest()
    return (root or default_root()) / f"{digest}.json"


def recall(policy: DraftLengthPolicy, key: dict[str, Any], root: Path | None = None) -> bool:
    """Give ``policy`` the state stored under ``key``; False (one debug line saying why,
    none for a missing file) where there is none it can use."""
    path = state_path(key, root)
    data = _read(path)
    if data is None:
        return False
    try:
        stored = json.loads(data.decode("utf-8"))
        if not isinstance(stored, dict) or stored.get("key") != json.loads(_canonical(key)):
            raise ValueError("stored for another drafter, model, device or format")
        policy.recall(stored.get("state"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        log.debug("draft-length memory %s ignored: %s", path, exc)
        return False
    return True


def store(policy: DraftLengthPolicy, key: dict[str, Any], root: Path | None = None) -> bool:
    """Keep ``policy``'s state under ``key`` (atomically: a temporary file renamed over
    the old one); False where it has none yet or the file cannot be written (one debug
    line)."""
    state = policy.state()
    if state is None:
        return False
    path = state_path(key, root)
    data = json.dumps({"key": json.loads(_canonical(key)), "state": state}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.debug("draft-length memory %s not written: %s", path, exc)
        return False
    _reap(path.parent)
    return True


#: A temporary file this old is a killed writer's, never one still being written (a write
#: takes milliseconds).
ORPHAN_AGE_S = 3600.0


def _reap(folder: Path) -> None:
    """Remove temporary files that killed writers left behind (never a live writer's)."""
    import time

    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        try:
            if tmp.is_file() and not tmp.is_symlink() and now - tmp.stat().st_mtime > ORPHAN_AGE_S:
                tmp.unlink()
        except OSError:
            pass  # another run reaped it first


def remember(engine: Any, *, sampled: bool, root: Path | None = None
             ) -> dict[str, Any] | None:
    """For one ``foretell run``: the key its speculator's state is kept under, after
    recalling what is stored there; None where nothing is to be kept (no speculator, a
    fixed draft length, a sampled request the drafter sits out, no model directory)."""
    speculator = getattr(engine, "speculator", None)
    if speculator is None or not speculator.adaptive or (sampled and not speculator.sampled):
        return None
    key = run_key(engine, speculator, sampled=sampled)
    if key is not None:
        recall(speculator.policy, key, root)
    return key


def run_key(engine: Any, speculator: Any, *, sampled: bool) -> dict[str, Any] | None:
    """The key of ``engine``'s speculator's state on this device, greedy or ``sampled``;
    None (one debug line) where the model has no directory to fingerprint or it cannot be
    read."""
    from foretell.spec.attach import draft_settings

    identity = getattr(engine.cache, "identity", None)
    if identity is not None:  # the prefix cache fingerprinted the target already
        target = identity.model_fingerprint
    elif engine.path is None:
        return None
    else:
        target = _fingerprint(Path(engine.path))
        if target is None:
            return None
    drafter = {k: v for k, v in draft_settings(speculator).items() if k != "adaptive"}
    return {"format": STATE_FORMAT, "target": target, "drafter": drafter,
            "device": device(), "sampled": sampled}


def _fingerprint(model_dir: Path) -> str | None:
    from foretell.store.entry import model_fingerprint, weights_digest

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        return model_fingerprint(config, weights_digest(model_dir))
    except Exception as exc:  # an unreadable model costs the memory, never the run
        log.debug("draft-length memory off: the target's fingerprint: %s", exc)
        return None


def device() -> str:
    """What the costs were measured on: MLX's device kind and its name."""
    import mlx.core as mx

    from foretell.spec.auto import machine_kind

    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # an MLX without device_info: the kind alone
        name = ""
    return f"{machine_kind()}:{name}"


def _canonical(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def _read(path: Path) -> bytes | None:
    """The file's bytes, or None (one debug line unless it is missing): read as every
    untrusted cache file is (:func:`foretell.store.files.read_bounded`: a regular file of
    at most MAX_BYTES, checked on the open descriptor, never a FIFO's wait)."""
    from foretell.errors import StoreError
    from foretell.store.files import read_bounded

    try:
        return read_bounded(path, MAX_BYTES, "a draft-length state")
    except FileNotFoundError:
        return None
    except (OSError, StoreError) as exc:
        log.debug("draft-length memory %s ignored: %s", path, exc)
        return None
