import subprocess
import sys

import pytest

from foretell import __version__
from foretell.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"foretell {__version__}"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "plugins" in capsys.readouterr().out


def test_bad_input_is_one_line_and_non_zero(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plugins", "--bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err == "foretell: error: unrecognized arguments: --bogus (see 'foretell --help')\n"


def test_console_script_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "foretell", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"foretell {__version__}"
