"""Where the files that come with this package are: libmemsnap.so and the memsnap CLI.

Three ways to get them, each looked at in this order:

- a wheel (``pip install memsnap``, ``pip install .``): the library sits in this package's
  folder and the CLI in the scripts folder of the environment that installed it (its place
  is read from the installation's record);
- ``pip install -e .`` from a clone: the library is built into this package's folder in the
  clone, the CLI into the environment's scripts folder;
- a cargo build of a clone, with this package imported from the clone's ``python/`` folder
  (``memsnap run`` puts it on PYTHONPATH, as it does a pip-installed package): ``target/release/`` then ``target/debug/``
  (first in ``$CARGO_TARGET_DIR`` when that is an absolute path).

Standard library only; nothing here runs at ``import memsnap`` beyond defining functions.
"""

import os

LIBRARY = "libmemsnap.so"
CLI = "memsnap"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _cargo_outputs(name):
    """``name`` in the cargo build folders of the clone this package is in, if it is in one."""
    root = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
    if not os.path.isfile(os.path.join(root, "Cargo.toml")):
        return []
    targets = [os.path.join(root, "target")]
    custom = os.environ.get("CARGO_TARGET_DIR", "")
    if os.path.isabs(custom):
        targets.insert(0, custom)
    return [os.path.join(t, profile, name) for t in targets for profile in ("release", "debug")]


def _not_found(what, looked, hint):
    return FileNotFoundError(
        "cannot find %s; looked in:\n  %s\n%s" % (what, "\n  ".join(looked), hint)
    )


def library_path():
    """The absolute path of the libmemsnap.so that came with this package.

    For ``LD_PRELOAD`` lines in job scripts:
    ``LD_PRELOAD=$(python -c 'import memsnap; print(memsnap.library_path())')``.
    Raises FileNotFoundError, naming every place it looked, when there is none.
    """
    candidates = [os.path.join(_PACKAGE_DIR, LIBRARY)] + _cargo_outputs(LIBRARY)
    for path in candidates:
        if os.path.isfile(path):
            return os.path.realpath(path)
    raise _not_found(
        LIBRARY,
        candidates,
        "Install memsnap with pip (pip install memsnap), or build it in the clone "
        "(cargo build --release --workspace).",
    )


def _installed_cli():
    """The CLI the installation of this package put in its scripts folder, if its record
    (the ``RECORD`` of the distribution that holds this very package) names one."""
    try:
        from importlib import metadata
    except ImportError:
        return None
    here = os.path.realpath(_PACKAGE_DIR)
    for dist in metadata.distributions(name="memsnap"):
        files = dist.files or []
        scripts = [f for f in files if f.name == CLI and f.parent.name == "bin"]
        if not scripts:
            continue
        packages = [
            os.path.realpath(os.path.dirname(str(dist.locate_file(f))))
            for f in files
            if f.name == "__init__.py" and f.parent.name == "memsnap"
        ]
        # An editable install's record lists no package files (they stay in the clone).
        if packages and here not in packages:
            continue
        path = str(dist.locate_file(scripts[0]))
        if os.path.isfile(path):
            return os.path.realpath(path)
    return None


def cli_path():
    """The absolute path of the memsnap CLI installed or built with this package.

    Raises FileNotFoundError, naming every place it looked, when there is none.
    """
    installed = _installed_cli()
    if installed:
        return installed
    candidates = _cargo_outputs(CLI)
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.realpath(path)
    looked = ["the scripts of the pip installation that holds %s" % _PACKAGE_DIR] + candidates
    raise _not_found(
        "the memsnap command",
        looked,
        "Install memsnap with pip (pip install memsnap), or build it in the clone "
        "(cargo build --release --workspace).",
    )
