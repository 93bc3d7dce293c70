"""One error hierarchy: every error foretell raises at a user is a ForetellError, defined in
foretell.errors, so a caller catches one base class and a reader finds them on one page."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import foretell
from foretell import errors

#: Never reach a user as themselves: the config structurer renders the first two into a
#: ConfigError; the store's FileReplaced and the CUDA staging's CudaCopyError are OSErrors,
#: handled like any failed read (not served, nothing dropped); the CLI's Terminated is
#: SIGTERM unwinding as Ctrl-C does, which the CLI turns into exit status 143; the server's
#: APIError is rendered as the API's own error JSON with its 4xx, and ClientGone is a
#: disconnect unwinding a reply.
INTERNAL = {
    "foretell.serve.errors.APIError",
    "foretell.serve.generation.ClientGone",
    "foretell.config.FieldError",
    "foretell.config.WrongType",
    "foretell.store.format.FileReplaced",
    "foretell.platform.cuda.driver.CudaCopyError",
    "foretell.cli.cache_cmd.Terminated",
    "foretell.plugin.testing.WriterKilled",  # unwinds a writer the layout suite stopped
}


def core_modules() -> list[str]:
    found = []
    for info in pkgutil.walk_packages(foretell.__path__, "foretell."):
        if info.name.endswith("__main__"):
            continue  # running it is the CLI
        found.append(info.name)
    return found


def exception_classes() -> dict[str, type]:
    classes = {}
    for name in core_modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("foretell"):
                if not issubclass(obj, Warning):
                    classes[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return classes


def test_every_core_exception_is_a_foretell_error_defined_in_errors():
    misplaced = {
        name
        for name, cls in exception_classes().items()
        if name not in INTERNAL
        and (cls.__module__ != "foretell.errors" or not issubclass(cls, errors.ForetellError))
    }
    assert misplaced == set()


@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("foretell.engine", "GenerationError"),
        ("foretell.engine", "ModelNotFound"),
        ("foretell.cache.codecs", "CodecError"),
        ("foretell.cli.bench_cmd", "BenchError"),
        ("foretell.store", "StoreError"),
        ("foretell.store.layout", "CorruptEntry"),
        ("foretell.tokenizer", "TokenizerError"),
        ("foretell.tokenizer", "ChatTemplateError"),
    ],
)
def test_the_modules_that_raise_an_error_re_export_the_one_in_errors(where, name):
    assert getattr(importlib.import_module(where), name) is getattr(errors, name)
    assert issubclass(getattr(errors, name), errors.ForetellError)


def test_a_missing_model_from_python_names_no_cli_flag():
    with pytest.raises(errors.ModelNotFound) as info:
        foretell.load("no-such-model-x")
    assert str(info.value).startswith("model 'no-such-model-x': no such directory")
    assert "--model" not in str(info.value)
