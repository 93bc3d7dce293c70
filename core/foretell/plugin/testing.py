"""Test helpers for plugin authors, behind the fixtures of :mod:`foretell.plugin.pytest_plugin`.

- :func:`fresh_plugins`: a :class:`TestPluginSet` with core's own plugins, nothing
  autoloaded (the ``foretell_plugins`` fixture).
- :func:`write_distribution` / :func:`fake_distributions`: real installed distributions
  (``.dist-info`` with entry points, plus modules) on ``sys.path``, so discovery runs as
  after ``pip install`` (the ``fake_distribution`` fixture).
- :func:`install_distribution`: a plugin's source tree really installed (pip, offline) into
  a directory of its own, which a test puts on ``sys.path`` and ``PYTHONPATH``.
- :func:`check_storage_layout`: a storage layout keeps the promises of
  :class:`foretell.store.layout.StorageLayout`, in one call from its own tests.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from foretell.plugin.loader import PluginRecord, PluginSet, PluginSwitches


class TestPluginSet(PluginSet):
    """A plugin set that never discovers entry points on its own."""

    __test__ = False  # not a test class, whatever its name says

    def load_entry_points(self) -> None:
        raise RuntimeError(
            "this test plugin set does not autoload entry points; register plugins with "
            "temporary() or build a PluginSet for discovery tests"
        )

    @contextlib.contextmanager
    def temporary(self, plugin: Any, name: str, **origin: Any) -> Iterator[PluginRecord]:
        record = self.register(plugin, name, **origin)
        try:
            yield record
        finally:
            self.unregister(name)


def fresh_plugins() -> TestPluginSet:
    plugins = TestPluginSet(PluginSwitches())
    plugins.load_core()
    return plugins


def write_distribution(
    root: Path,
    name: str,
    version: str = "0.1.0",
    *,
    entry_points: Mapping[str, Mapping[str, str]] | None = None,
    modules: Mapping[str, str] | None = None,
) -> Path:
    """Write an installed distribution under ``root``: ``<name>-<version>.dist-info`` with
    METADATA and entry_points.txt, plus ``modules`` (``{"pkg.mod": source}``)."""
    root.mkdir(parents=True, exist_ok=True)
    dist_info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    sections = []
    for group, eps in (entry_points or {}).items():
        lines = "\n".join(f"{k} = {v}" for k, v in eps.items())
        sections.append(f"[{group}]\n{lines}\n")
    (dist_info / "entry_points.txt").write_text("\n".join(sections), encoding="utf-8")
    (dist_info / "RECORD").write_text("", encoding="utf-8")
    for dotted, source in (modules or {}).items():
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            pkg = root.joinpath(*parts[:i])
            pkg.mkdir(exist_ok=True)
            (pkg / "__init__.py").touch()
        target = root.joinpath(*parts[:-1], parts[-1] + ".py")
        target.write_text(textwrap.dedent(source), encoding="utf-8")
    return root


@contextlib.contextmanager
def fake_distributions(root: Path, monkeypatch: Any) -> Iterator[Any]:
    """``make(name, version, entry_points=..., modules=...)`` writes a distribution under
    ``root`` and puts it on ``sys.path``; on exit its modules leave ``sys.modules``."""
    created: list[str] = []

    def make(name: str, version: str = "0.1.0", **kwargs: Any) -> Path:
        site = write_distribution(root / f"site-{len(created)}", name, version, **kwargs)
        monkeypatch.syspath_prepend(str(site))
        created.extend(kwargs.get("modules") or {})
        importlib.invalidate_caches()
        return site

    try:
        yield make
    finally:
        for module in created:
            top = module.split(".")[0]
            for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[loaded]


def check_storage_layout(open_layout: Callable[[Any], Any], *,
                         damage: Callable[[Any, str], None] | None = None) -> None:
    """Check that a storage layout keeps the contract of
    :class:`foretell.store.layout.StorageLayout`, raising ``AssertionError`` at the first
    promise it breaks (a layout that stores nothing fails).

    ``open_layout(identity)`` opens the layout under test over one store, the same store
    at every call (a directory, a server's database), empty at the first; it is called
    again to see what another process opening that store would, and with another identity
    (another tokenizer) whose layout must neither serve nor delete the first's entries.
    ``damage(layout, key)`` changes the stored bytes of the entry under ``key`` as a fault
    would (a flipped byte of its tensor data); a read must then refuse it, return None, and
    no later scan may list it.

    Checked: ``key_for`` (equal states, equal keys; namespace and tokens tell keys apart),
    ``write`` (True, listed by ``headers``/``scan`` with its tokens, namespace, layers and
    bytes, seen by another instance over the store), ``read`` (every tensor back bit for bit;
    None for an absent key; marks the entry used), rewriting one state (still one entry),
    identities (another's layout serves none of them and deletes none), ``remove`` (True once,
    then False; never served again), ``collect`` and ``bytes`` (freed once an entry is
    removed, never a servable entry), with ``damage`` a verified read, and last a writer
    killed part way through a write or a rewrite (:func:`check_killed_writer`): nothing
    half-written served or listed, the entry it rewrote and the others intact, the layout
    still working. The layout's ``write`` runs in a thread of its own there, as the tier's
    spill worker runs it.
    """
    import mlx.core as mx
    import numpy as np

    from foretell.cache.codecs import StandardKVCodec, snapshot_entry
    from foretell.model import KVCache
    from foretell.store.entry import StoreIdentity

    codec = StandardKVCodec()
    mine = StoreIdentity(model_fingerprint="c0nf0rm4nc3c4fe0", model_id="conformance/tiny",
                         tokenizer_hash="tokenizer-a", codec_providers=[codec.provider_id])
    theirs = StoreIdentity(model_fingerprint=mine.model_fingerprint, model_id=mine.model_id,
                           tokenizer_hash="tokenizer-b", codec_providers=[codec.provider_id])

    def state(n: int, seed: int, namespace: str = "") -> Any:
        cache = KVCache()
        keys = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
        cache.update_and_fetch(keys, keys * 2 + 1)
        return snapshot_entry(range(n), [cache], [codec], namespace)

    def same(read: Any, written: Any, what: str) -> None:
        assert read is not None, f"{what}: read() returned None for an entry just written"
        assert tuple(read.tokens) == tuple(written.tokens), f"{what}: tokens differ"
        assert read.namespace == written.namespace, f"{what}: namespace differs"
        assert len(read.layers) == len(written.layers), f"{what}: layer count differs"
        for got, want in zip(read.layers, written.layers):
            assert (got.codec, got.provider, dict(got.meta)) == (
                want.codec, want.provider, dict(want.meta)), f"{what}: a layer's codec or meta differs"
            assert set(got.tensors) == set(want.tensors), f"{what}: tensor names differ"
            for name, tensor in want.tensors.items():
                back = got.tensors[name]
                assert (back.dtype, tuple(back.shape)) == (tensor.dtype, tuple(tensor.shape)), (
                    f"{what}: tensor {name} came back as {back.dtype}{tuple(back.shape)}")
                assert np.array_equal(np.asarray(back.view(mx.uint8)),
                                      np.asarray(tensor.view(mx.uint8))), (
                    f"{what}: tensor {name}'s bytes differ")

    layout = open_layout(mine)
    assert layout.identity == mine, "the layout's identity is not the one it was opened with"
    assert isinstance(layout.io_failures, int), "io_failures must be an int"
    assert layout.scan() == [] and layout.headers() == [], "a new store lists entries"
    assert layout.bytes() == 0, "a new store counts bytes"

    first, longer, other = state(12, 1), state(20, 2), state(12, 1, namespace="adapter-b")
    key = layout.key_for(first.tokens, first.namespace)
    assert key == layout.key_for(list(first.tokens), ""), "key_for differs for equal states"
    assert key != layout.key_for(other.tokens, other.namespace), "namespaces share keys"
    assert key != layout.key_for(longer.tokens), "different tokens share a key"
    assert layout.read(key) is None, "read() of an absent key returned an entry"

    assert layout.write(first) is True, "write() of an entry did not return True"
    listed = layout.headers()
    assert [h.key for h in listed] == [key], (
        "headers() does not list the written entry under key_for's key")
    header = listed[0]
    assert (tuple(header.tokens), header.namespace) == (first.tokens, ""), (
        "headers() lists the entry with other tokens or another namespace")
    assert [(la.codec, la.provider) for la in header.layers] == [
        (la.codec, la.provider) for la in first.layers], "the header's layers differ"
    assert header.nbytes >= first.tensor_bytes, "the header counts fewer bytes than it holds"
    assert layout.bytes() >= first.tensor_bytes, "bytes() counts less than the entry holds"
    same(layout.read(key), first, "read")

    again = open_layout(mine)
    assert [h.key for h in again.scan()] == [key], "another instance over the store lists " \
        "other entries than were written"
    same(again.read(key), first, "read by another instance")

    foreign = open_layout(theirs)
    assert foreign.scan() == [], "another identity's layout lists this identity's entries"
    assert foreign.read(key) is None, "another identity's layout serves this identity's entry"
    foreign.collect()
    same(layout.read(key), first, "read after another identity's scan and collect")

    assert layout.write(first) is True, "rewriting an entry did not return True"
    assert [h.key for h in layout.scan()] == [key], "rewriting one state added an entry"

    longer_key = layout.key_for(longer.tokens)
    assert layout.write(longer) is True and layout.write(other) is True
    assert {h.key for h in layout.scan()} == {key, longer_key, layout.key_for(
        other.tokens, other.namespace)}, "scan() does not list every written entry"
    before = {h.key: h.last_used for h in layout.headers()}
    same(layout.read(key), first, "read among others")
    after = {h.key: h.last_used for h in layout.scan()}
    assert after[key] >= max(before.values()), "a read did not mark its entry used"
    assert [h.last_used for h in layout.scan()] == sorted(after.values()), (
        "scan() is not least recently used first")

    held = layout.bytes()
    assert layout.remove(key) is True, "remove() of a stored entry did not return True"
    assert layout.read(key) is None, "a removed entry is still served"
    assert key not in {h.key for h in layout.scan()}, "a removed entry is still listed"
    assert layout.remove(key) is False, "remove() of an absent entry returned True"
    assert isinstance(layout.collect(), int), "collect() must return the bytes it freed"
    assert layout.bytes() < held, "bytes() did not drop once an entry was removed"
    same(layout.read(longer_key), longer, "read after another entry's removal and collect")

    if damage is not None:
        damage(layout, longer_key)
        assert layout.read(longer_key) is None, "a damaged entry was served"
        assert longer_key not in {h.key for h in open_layout(mine).scan()}, (
            "a damaged entry is still listed after a read refused it")

    check_killed_writer(open_layout, mine, kept=other, new=state(28, 3), same=same)


class WriterKilled(BaseException):
    """Raised in a stopped writer's thread to unwind it (a ``BaseException``: the
    ``except Exception`` clauses of the write it stops do not run)."""


#: Lines of a write at which :func:`check_killed_writer` kills it, spread over the write.
KILL_POINTS = 32


class _StoppedWrite:
    """``layout.write(entry)`` in a thread of its own, stopped for good at its ``stop``-th
    line of Python in ``packages`` (0: run to the end, counting lines), as if its process
    were killed there: the thread waits until :meth:`unwind`, which raises
    :class:`WriterKilled` at that line."""

    def __init__(self, layout: Any, entry: Any, packages: set[str], stop: int) -> None:
        self.lines = 0
        self.at = ""
        self.error: BaseException | None = None
        self._stop, self._packages = stop, packages
        self._stopped, self._settled, self._go = (threading.Event(), threading.Event(),
                                                  threading.Event())
        self._thread = threading.Thread(target=self._run, args=(layout, entry), daemon=True,
                                        name="foretell-killed-writer")
        self._thread.start()
        assert self._settled.wait(120), "write() ran for two minutes without finishing"
        if self.error is not None:
            raise AssertionError(f"write() raised {self.error!r}") from self.error

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def unwind(self) -> None:
        self._go.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), f"a writer killed at {self.at} never unwound"

    def _run(self, layout: Any, entry: Any) -> None:
        def line(frame: Any, event: str, _arg: Any) -> Any:
            if event == "line":
                self.lines += 1
                if self.lines == self._stop:
                    code = frame.f_code
                    self.at = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}()"
                    self._stopped.set()
                    self._settled.set()
                    self._go.wait()
                    raise WriterKilled(self.at)  # also ends tracing in this thread
            return line

        def call(frame: Any, _event: str, _arg: Any) -> Any:
            package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
            return line if package in self._packages else None

        sys.settrace(call)
        try:
            layout.write(entry)
        except WriterKilled:
            pass
        except BaseException as exc:  # reported by the check, whatever it is
            self.error = exc
        finally:
            sys.settrace(None)
            self._settled.set()


def _spread(total: int, count: int) -> list[int]:
    if total <= count:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (count - 1)) for i in range(count)})


def check_killed_writer(open_layout: Callable[[Any], Any], identity: Any, *, kept: Any,
                        new: Any, same: Callable[[Any, Any, str], None]) -> None:
    """A writer killed at any point of a write leaves nothing half-written served, the
    entries already stored intact (the one it rewrote included), and a layout that works.

    The store holds ``kept``. A writer (a fresh ``open_layout(identity)``, as another
    process) writes ``new``, or rewrites ``kept``, in a thread traced line by line through
    the code of foretell and of the layout's package, and stops for good at one of
    :data:`KILL_POINTS` lines spread over the write. While it is stopped, another fresh
    layout over the store must list ``kept`` and read it back bit for bit, read ``new`` back
    whole or not at all, and list ``new`` only if it serves it. The writer is then unwound
    (:class:`WriterKilled` raised at its line, so its ``finally`` blocks run as the kernel
    would close a dead process's files and locks), and a fresh layout must write ``new``,
    serve both, remove ``new``, collect, and count the bytes it counted before.
    ``same(read, written, what)`` asserts that an entry read back equals the one written.
    """
    import mlx.core as mx

    for entry in (kept, new):  # the writer's thread has no MLX stream of its own
        mx.eval([t for layer in entry.layers for t in layer.tensors.values()])
    view = open_layout(identity)
    kept_key, new_key = (view.key_for(e.tokens, e.namespace) for e in (kept, new))
    assert kept_key in {h.key for h in view.scan()}, "the entry to keep is not stored"
    baseline = view.bytes()
    packages = {"foretell", type(view).__module__.partition(".")[0]}
    for entry, what in ((new, "a write of a new entry"), (kept, "a rewrite of a stored entry")):
        total = _StoppedWrite(open_layout(identity), entry, packages, stop=0).lines
        for stop in _spread(total, KILL_POINTS):
            writer = _StoppedWrite(open_layout(identity), entry, packages, stop)
            killed = f"{what} killed at line {stop} of {total} ({writer.at or 'its end'})"
            # A checker blocked on something only the stopped thread holds (a lock of
            # this process) goes on once the writer is unwound, as after a real kill.
            watchdog = threading.Timer(10, writer.unwind)
            watchdog.start()
            try:
                view = open_layout(identity)
                listed = {h.key for h in view.scan()}
                assert kept_key in listed, f"{killed}: the entry stored before is no longer listed"
                same(view.read(kept_key), kept, f"{killed}: the entry stored before")
                served = view.read(new_key) if entry is new else None
                if served is not None:
                    same(served, new, f"{killed}: the entry it was writing")
                assert served is not None or entry is kept or new_key not in listed, (
                    f"{killed}: the entry it left half-written is listed")
            finally:
                watchdog.cancel()
                writer.unwind()
            view = open_layout(identity)
            assert view.write(new) is True, f"after {killed}: write() failed"
            same(view.read(new_key), new, f"after {killed}: an entry written since")
            same(view.read(kept_key), kept, f"after {killed}: the entry stored before")
            assert view.remove(new_key) is True, f"after {killed}: remove() failed"
            view.collect()
            if entry is new:  # a rewrite may store a header of another length
                assert open_layout(identity).bytes() == baseline, (
                    f"after {killed}, a write, a remove and collect: bytes() counts "
                    f"{open_layout(identity).bytes()}, {baseline} before")



def install_distribution(source: Path, root: Path) -> Path:
    """``pip install`` the distribution at ``source`` into ``root / "site"`` (offline, no
    dependencies, into the running interpreter's own setuptools) and return that directory:
    a real installed distribution, entry points and all, that leaves the environment the
    tests run in as it was. Built from a copy, since setuptools writes an ``.egg-info``
    beside the sources it builds, which would make the checkout look installed.

    :raises RuntimeError: pip failed; its error output is in the message."""
    import shutil
    import subprocess

    copy = shutil.copytree(source, root / "src", ignore=shutil.ignore_patterns(
        "*.egg-info", "build", "__pycache__", "tests"))
    site = root / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
         "--no-deps", "--no-build-isolation", "--no-index", "--target", str(site), str(copy)],
        capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"installing {source} for the tests failed:\n{done.stderr}")
    return site


#: The conformance suites of the other plugin kinds (one line each from a plugin's tests).
#: They drive an engine from the top, so they live in foretell.tools.conformance, which
#: the engine's own modules never import (tests/core/test_layout.py): resolved on first use.
_SUITES = ("check_architecture", "check_cache_codec", "check_draft_provider")


def __getattr__(name: str) -> Any:
    if name in _SUITES:
        return getattr(importlib.import_module("foretell.tools.conformance"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
