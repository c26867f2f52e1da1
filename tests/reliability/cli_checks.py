"""What the reliability tests check of a command line: a config written as a user's file, and a
one-line error with exit status 2."""

import json

from jaxrl.cli import main


def write_config(folder, config: dict) -> str:
    """``config`` as ``folder/config.json``; returns its path."""
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def one_line_exit_2(capfd, argv, expected: str) -> None:
    """``jaxrl ARGV`` exits 2 with one line on stderr that holds ``expected``."""
    assert main(argv) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
