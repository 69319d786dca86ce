"""``python -m memsnap ...``: the memsnap command that came with this package.

``python -m memsnap run -- python train.py`` is ``memsnap run -- python train.py`` with the
library that came with this package preloaded (unless ``--lib`` is given: the library's path
travels in ``MEMSNAP_RUN_LIB``, which ``memsnap run`` reads and does not pass on, so its usage
and errors show only what was typed); every other
subcommand (``summary``, ``diff``, ``dump``, ``view``, ...) goes to the CLI unchanged. Useful
where the environment's scripts folder is not on PATH (``python -m`` always finds it).
"""

import os
import sys

from ._locate import cli_path, library_path


def main(argv):
    try:
        cli = cli_path()
        if argv[:1] == ["run"]:
            os.environ["MEMSNAP_RUN_LIB"] = library_path()
    except FileNotFoundError as e:
        print("python -m memsnap: %s" % e, file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    # The CLI takes this process's place: its exit status, signals and output are the run's.
    os.execv(cli, [cli] + argv)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
