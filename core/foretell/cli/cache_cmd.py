"""``foretell cache ls|stats|verify|gc|clear --cache-dir DIR``: look after a cache directory,
or the store a URL names (``redis://HOST:PORT/DB``: the layout registered for its scheme).

Without ``--model`` every single-file entry under the directory is examined under the
identity it claims (model, tokenizer, KV scheme), so one directory shared by several models
is listed whole, and so is every identity a URL's layout says it holds
(``stored_identities``); with ``--model`` only that model's entries (in ``--layout``) are.
``verify`` reads every entry back with every checksum and reports the bad ones (they are
deleted, as a read during serving would); it exits 1 if any was bad. ``--json`` prints one
JSON object.

Also here: :func:`flushing`, the bounded durability wait ``run`` and ``chat`` do on exit,
SIGINT and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from foretell.cache.spill import CLOSE_TIMEOUT_S
from foretell.errors import ForetellError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help="list, check and clean a cache directory")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    for name, summary in (
        ("ls", "list stored entries"),
        ("stats", "entries and bytes per model and KV scheme"),
        ("verify", "read every entry with every checksum; report (and delete) bad ones"),
        ("gc", "delete interrupted writes, entries unused for --older-than days, and "
               "evict to --max-gb"),
        ("clear", "delete every entry and the storage it used"),
    ):
        a = actions.add_parser(name, help=summary)
        a.add_argument("--cache-dir", required=True, metavar="DIR",
                       help="the cache directory, or the URL of a store (redis://HOST:PORT/DB)")
        a.add_argument("--model", "-m", default=None,
                       help="only this model's entries (directory or shipped name; default: "
                            "every model's)")
        a.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                       help="with --model: the KV scheme's entries (default: unquantized KV)")
        a.add_argument("--layout", default=None,
                       help="with --model: the storage layout (default: [cache] layout's, "
                            "blocks)")
        a.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "gc":
            a.add_argument("--max-gb", type=gigabytes, default=None,
                           help="evict least recently used entries down to this many GiB "
                                "(per model and KV scheme, as --cache-max-gb caps them; "
                                "default: no eviction by size)")
            a.add_argument("--older-than", type=days, default=None, metavar="DAYS",
                           help="delete entries last used more than DAYS days ago, of every "
                                "model and scheme (entries of weights since changed, or of "
                                "a model no longer run, are never used again; default: none "
                                "deleted by age)")
        a.set_defaults(handler=globals()[f"cmd_{name}"])
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def gigabytes(text: str) -> float:
    """``--max-gb``: a finite size >= 0 (nan or inf cannot be a cap; a negative one would
    evict everything)."""
    return _finite_at_least_zero(text, "GiB")


def days(text: str) -> float:
    """``--older-than``: a finite number of days >= 0."""
    return _finite_at_least_zero(text, "days")


def _finite_at_least_zero(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


# -- which layouts ------------------------------------------------------------------------


#: Each layout class's registered name, as :func:`layouts` found them.
_LAYOUT_NAMES: dict[type, str] = {}


def layout_name(layout: Any) -> str:
    """The name ``layout`` is registered under (``[cache] layout``, ``--layout``)."""
    return _LAYOUT_NAMES.get(type(layout), type(layout).__name__)


def layouts(args: argparse.Namespace) -> list[Any]:
    """The layouts to act on: the model's, or one per identity found in the directory."""
    from foretell.cache.codecs import load_codecs
    from foretell.config import DEFAULT_LAYOUT
    from foretell.plugin.loader import load_plugins
    from foretell.plugin.registry import Kind
    from foretell.store.entry import StoreIdentity
    from foretell.store.single_file import SingleFileLayout

    if not args.cache_dir.strip():  # Path("") is the current directory: not what was meant
        raise ForetellError("--cache-dir is empty: give the cache directory")
    root = cache_root(args)
    if isinstance(root, Path) and not root.is_dir():
        raise ForetellError(f"--cache-dir {args.cache_dir}: no such directory")
    if args.model is None and (args.kv_bits is not None or args.layout is not None):
        flag = "--kv-bits" if args.kv_bits is not None else "--layout"
        raise ForetellError(f"{flag} selects among one model's entries: give --model too "
                            "(without it every model, scheme and layout is examined)")
    registry = load_plugins().registry
    providers = [c.provider_id for c in load_codecs(registry)]
    for name in registry.names(Kind.LAYOUT):
        _LAYOUT_NAMES.setdefault(registry.get(Kind.LAYOUT, name).load(), name)
    serving = registry.layout_for(root)  # a URL's layout; None for a directory
    if serving is not None and args.layout not in (None, serving.name):
        raise ForetellError(f"--layout {args.layout} does not store at {root}: layout "
                            f"'{serving.name}' does")
    if args.model is not None:
        from foretell.cache.quantized import kv_scheme
        from foretell.cli.run_cmd import model_path

        path = model_path(args.model)
        try:
            identity = StoreIdentity.for_model_dir(
                path, model_id=path.name, codec_providers=providers,
                kv_scheme=kv_scheme(args.kv_bits))
        except OSError as exc:
            raise ForetellError(f"--model {args.model}: {exc.filename}: {exc.strerror}") from None
        except ValueError as exc:  # config.json that is not UTF-8 JSON
            raise ForetellError(
                f"--model {args.model}: {path / 'config.json'}: not JSON ({exc})") from None
        contribution = serving or registry.get(Kind.LAYOUT, args.layout or DEFAULT_LAYOUT)
        config = contribution.config() if contribution.config is not None else None
        return [contribution.load()(root, config, identity=identity)]
    if serving is not None:
        factory = serving.load()
        discover = getattr(factory, "stored_identities", None)
        if discover is None:
            raise ForetellError(f"layout '{serving.name}' cannot say which models' entries "
                                f"{root} holds: give --model")
        config = serving.config() if serving.config is not None else None
        return [factory(root, config, identity=i) for i in discover(root, providers)]
    found = [SingleFileLayout(root, identity=identity)
             for identity in claimed_identities(root, providers)]
    # Other layouts (the block store) say which identities they hold under the root.
    for name in registry.names(Kind.LAYOUT):
        contribution = registry.get(Kind.LAYOUT, name)
        factory = contribution.load()
        discover = getattr(factory, "stored_identities", None)
        if discover is not None and not contribution.schemes:  # URL layouts: not directories
            config = contribution.config() if contribution.config is not None else None
            found += [factory(root, config, identity=i) for i in discover(root, providers)]
    return found


def cache_root(args: argparse.Namespace) -> Path | str:
    """``--cache-dir``: a directory's path, or a URL as given (``redis://...``)."""
    from foretell.store.layout import url_scheme

    if url_scheme(args.cache_dir) is not None:
        return args.cache_dir.strip()
    return Path(args.cache_dir).expanduser()


def claimed_identities(root: Path, providers: list[str]) -> list[Any]:
    """Every identity some single-file entry under ``root`` claims in its header."""
    from foretell.store import format as fmt
    from foretell.store.entry import StoreIdentity

    seen = {}
    for path in sorted(root.glob(f"*/*{fmt.SUFFIX}")):
        fields = _claimed_fields(path)
        if fields is None:
            continue
        try:
            identity = StoreIdentity(
                model_fingerprint=fields["model_fingerprint"], kv_scheme=fields["kv_scheme"],
                model_id=fields["model_id"], tokenizer_hash=fields["tokenizer_hash"],
                codec_providers=providers)
        except (KeyError, TypeError, ValueError):
            continue
        if identity.directory == path.parent.name:
            seen[(identity.directory, identity.model_id, identity.tokenizer_hash)] = identity
    return list(seen.values())


def _claimed_fields(path: Path) -> dict[str, Any] | None:
    import struct

    from foretell.store import format as fmt
    from foretell.store.files import open_regular
    from foretell.store.layout import StoreError

    try:
        with open_regular(path) as fh:  # a FIFO named like an entry must not hang `ls`
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > fmt.MAX_HEADER_BYTES:
                return None
            meta = json.loads(fh.read(length))["__metadata__"]
        return json.loads(meta["foretell.header"])
    except (OSError, StoreError, ValueError, KeyError, TypeError, struct.error):
        return None


def location(layout: Any, key: str) -> str:
    """Where the entry under ``key`` lives, as the layout says (``foretell.store.
    LocatesEntries``: a file's path for the built-in layouts), else ``<layout>:<key>``."""
    from foretell.store.layout import LocatesEntries

    if isinstance(layout, LocatesEntries):
        return layout.location(key)
    return f"{layout_name(layout)}:{key}"


def skipped_entries(found: list[Any]) -> list[dict[str, str]]:
    """Entry files the layouts' scans passed over (another model's or tokenizer's, an unknown
    version, a codec provider not loaded here: ``foretell.store.ReportsSkipped``) and that no
    layout serves, each with why. Call after every layout has scanned."""
    from foretell.store.layout import ReportsSkipped

    served = {location(layout, h.key) for layout in found for h in layout.headers()}
    why: dict[str, str] = {}
    for layout in found:
        if isinstance(layout, ReportsSkipped):
            why.update(layout.skipped)
    return [{"path": path, "reason": reason} for path, reason in sorted(why.items())
            if path not in served]


def _say_skipped(skipped: list[dict[str, str]]) -> None:
    """One line per reason, so a directory that looks empty here says why."""
    if not skipped:
        return
    counts: dict[str, int] = {}
    for s in skipped:
        counts[s["reason"]] = counts.get(s["reason"], 0) + 1
    print(f"{len(skipped)} entries kept but not served here (`foretell cache ls --json` "
          "lists them):")
    for reason, n in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"  {n} × {reason}")


def _orphans(root: Path | str) -> list[Path]:
    """Interrupted single-file writes under ``root``; none in a directory that leads
    outside it (a symbolic link to elsewhere: those files are not this cache's), nor at a
    URL (its layout reaps its own at ``collect``)."""
    from foretell.store.files import outside_root

    if not isinstance(root, Path):
        return []
    return sorted(p for p in root.glob("*/*.tmp") if outside_root(root, p.parent) is None)


# -- the actions ----------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    rows = []
    found = layouts(args)
    for layout in found:
        for h in layout.scan():
            rows.append({
                "model_id": layout.identity.model_id, "directory": layout.identity.directory,
                "layout": layout_name(layout), "key": h.key, "namespace": h.namespace,
                "tokens": len(h.tokens), "bytes": h.nbytes, "last_used": h.last_used,
                "codecs": sorted({la.codec for la in h.layers}),
            })
    skipped = skipped_entries(found)
    if args.json:
        print(json.dumps({"entries": rows, "skipped": skipped}))
        return 0
    model = max([len("MODEL"), *(len(r["model_id"]) for r in rows)])
    layout = max([len("LAYOUT"), *(len(r["layout"]) for r in rows)])
    if rows:
        print(f"{'KEY':<32}  {'TOKENS':>11}  {'SIZE':>9}  {'LAST USED':<19}  "
              f"{'MODEL':<{model}}  {'LAYOUT':<{layout}}  NAMESPACE")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["last_used"]))
        print(f"{r['key']:<32}  {r['tokens']:>7} tok  {_size(r['bytes']):>9}  {when}  "
              f"{r['model_id']:<{model}}  {r['layout']:<{layout}}  {r['namespace'] or '-'}")
    if not rows:
        print("no entries")
    _say_skipped(skipped)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    groups = []
    found = layouts(args)
    for layout in found:
        headers = layout.scan()
        logical, disk = sum(h.nbytes for h in headers), layout.bytes()
        # bytes: what the entries hold; disk_bytes: what they take (shared blocks once).
        groups.append({"model_id": layout.identity.model_id,
                       "directory": layout.identity.directory, "layout": layout_name(layout),
                       "entries": len(headers), "bytes": logical, "disk_bytes": disk,
                       "dedup_ratio": round(logical / disk, 3) if disk else 1.0,
                       "tokens": sum(len(h.tokens) for h in headers)})
    root = cache_root(args)
    summary = {"cache_dir": str(root), "models": groups,
               "entries": sum(g["entries"] for g in groups),
               "bytes": sum(g["bytes"] for g in groups),
               "disk_bytes": sum(g["disk_bytes"] for g in groups),
               "interrupted_writes": len(_orphans(root)),
               "skipped": (skipped := skipped_entries(found))}
    if args.json:
        print(json.dumps(summary))
        return 0
    for g in groups:
        print(f"{g['model_id']} ({g['directory']}, {g['layout']}): {g['entries']} entries, "
              f"{_size(g['bytes'])} ({_size(g['disk_bytes'])} on disk, dedup "
              f"{g['dedup_ratio']:.2f}x), {g['tokens']} tokens")
    print(f"total: {summary['entries']} entries, {_size(summary['bytes'])} "
          f"({_size(summary['disk_bytes'])} on disk); "
          f"{summary['interrupted_writes']} interrupted writes")
    _say_skipped(skipped)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from foretell.store import format as fmt
    from foretell.store.layout import ReportsDropped

    root = cache_root(args)
    found = layouts(args)
    good, bad = 0, []
    for layout in found:
        headers = layout.scan()
        # What the scan itself deleted (a damaged header), before any read adds to it.
        if isinstance(layout, ReportsDropped):
            bad += [{"key": key, "path": location(layout, key), "reason": reason}
                    for key, reason in layout.dropped.items()]
        for h in headers:
            reason = _damage(layout, h.key)
            if reason is None:
                good += 1
            else:
                bad.append({"key": h.key, "path": location(layout, h.key), "reason": reason})
    skipped = skipped_entries(found)
    strays = []
    if args.model is None and isinstance(root, Path):
        # Single-file entries no identity claimed (core's own layout, which claimed_identities
        # reads): kept, and said so, as other skipped files are.
        said = {s["path"] for s in skipped} | {b["path"] for b in bad} | {
            location(layout, h.key) for layout in found for h in layout.headers()}
        strays = [{"path": str(path), "reason": "not a foretell entry"}
                  for path in sorted(root.glob(f"*/*{fmt.SUFFIX}"))
                  if str(path) not in said and _claimed_fields(path) is None]
    report = {"verified": good, "bad": bad, "skipped": skipped + strays}
    if args.json:
        print(json.dumps(report))
    else:
        for b in bad:
            print(f"bad: {b['path']} ({b['reason']})")
        print(f"{good} entries verified, {len(bad)} bad")
        _say_skipped(report["skipped"])
    return 1 if bad else 0


def _damage(layout: Any, key: str) -> str | None:
    """Why the entry under ``key`` cannot be served (None: every byte verified). Read
    without marking it used, so checking does not reorder eviction; a damaged entry is
    then read as serving reads it, which deletes it."""
    from foretell.store.layout import StoreError

    check = getattr(layout, "read_layers", None)  # both built-in layouts have it
    if check is None:
        return None if layout.read(key) is not None else "unreadable"
    try:
        check(key)
        return None
    except (StoreError, OSError) as exc:
        layout.read(key)
        return str(exc) or type(exc).__name__


def _on_disk(layout: Any) -> tuple[set[str], int]:
    """The keys of the entries the layout finds on disk now, and their bytes."""
    return {h.key for h in layout.scan()}, layout.bytes()


def _left_the_disk(layout: Any, change: Callable[[Any], Any]) -> tuple[int, int, int]:
    """Run ``change(layout)``; the entries that left the disk, those still on it, and the
    bytes freed: what did leave, not what was asked to (a read-only directory keeps all)."""
    keys, before = _on_disk(layout)
    change(layout)
    left, after = _on_disk(layout)
    return len(keys - left), len(left), before - after


def _remove_unused(layout: Any, unused_since: float = math.inf) -> None:
    """Remove the entries last used before ``unused_since`` (by default every one), and the
    blocks only they listed."""
    for header in layout.scan():
        if header.last_used < unused_since:
            layout.remove(header.key)
    layout.collect()


def cmd_gc(args: argparse.Namespace) -> int:
    from foretell.cache.codecs import load_codecs
    from foretell.cache.ssd import SsdIndex
    from foretell.plugin.loader import load_plugins

    codecs = load_codecs(load_plugins().registry)
    changes: list[Callable[[Any], Any]] = []
    if args.older_than is not None:
        changes.append(functools.partial(
            _remove_unused, unused_since=time.time() - args.older_than * 86400))
    if args.max_gb is not None:
        cap = int(args.max_gb * (1 << 30))
        changes.append(lambda layout: SsdIndex(layout, codecs, cap).scan())
    freed = evicted = 0
    for layout in layouts(args):
        freed += layout.collect()
        for change in changes:
            gone, _, gone_bytes = _left_the_disk(layout, change)
            evicted, freed = evicted + gone, freed + gone_bytes
    report = {"freed_bytes": freed, "evicted": evicted}
    print(json.dumps(report) if args.json else
          f"freed {_size(freed)}; evicted {evicted} entries")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    removed = kept = freed = 0
    found = layouts(args)
    for layout in found:
        freed += layout.collect()  # what no entry used already
        gone, still, gone_bytes = _left_the_disk(layout, _remove_unused)
        removed, kept, freed = removed + gone, kept + still, freed + gone_bytes
    root = cache_root(args)
    if args.model is None:
        for orphan in _orphans(root):
            with contextlib.suppress(OSError):
                orphan.unlink()
    skipped = skipped_entries(found)  # not this foretell's to judge: kept, and said so
    if args.json:
        print(json.dumps({"removed": removed, "not_removed": kept, "freed_bytes": freed,
                          "skipped": skipped}))
        return 1 if kept else 0
    print(f"removed {removed} entries, freed {_size(freed)}")
    if kept:
        print(f"{kept} entries could not be removed (a read-only directory?)")
    _say_skipped(skipped)
    return 1 if kept else 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# -- durability on exit -----------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM where :func:`flushing` waits on the cache: it unwinds as Ctrl-C does (the
    cache flushes on the way out), ends ``chat`` rather than only its turn, and the process
    exits 143 (128 + SIGTERM), as one killed by the signal would."""


@contextlib.contextmanager
def flushing(tier: Any, timeout: float = CLOSE_TIMEOUT_S, quiet: bool = False) -> Iterator[None]:
    """Run the body; then (also after SIGINT or SIGTERM) wait up to ``timeout`` seconds
    for queued cache writes, and say on stderr if the cache is not durable."""
    if tier is None:
        yield
        return

    def terminate(_signum: int, _frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        report = tier.close(timeout)
        if tier.ssd is not None and not report.durable and not quiet:
            print(f"foretell: warning: the cache is not durable ({report.shortfall()})",
                  file=sys.stderr)
