"""The version, in a module of its own: the CLI reads it from here, so a folder named
trainprobes in the current directory (a clone, run from its parent), which Python imports as
a namespace package in place of an editable install, still finds it."""
__version__ = "0.2.1"
