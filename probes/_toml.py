"""TOML parsing on every supported Python: tomllib from 3.11, its backport tomli on 3.10."""
import sys

if sys.version_info >= (3, 11):
    import tomllib as _toml  # novermin: guarded by the version check
else:
    import tomli as _toml

loads = _toml.loads
TOMLDecodeError = _toml.TOMLDecodeError
