"""The user's array files read without unpickling: one .npz reader for every command that
takes them (drift's log-probs, gemm's operands), each fault a DataFileError naming the file."""
from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

from trainprobes.errors import DataFileError


def read_npz(path, writer: str = "numpy.savez") -> dict:
    """{name: numpy array} of an .npz archive, loaded with allow_pickle=False. `writer`: how to
    write the file, named in the messages."""
    import numpy as np
    path = Path(path)
    with open(path, "rb") as f:  # numpy calls any non-zip file "pickled data"
        head = f.read(4)
    if head != b"PK\x03\x04":
        raise DataFileError(f"{str(path)!r} is not an .npz archive (it starts with {head!r}, not a zip "
                            f"header); write it with {writer}")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except ValueError as e:
        if "allow_pickle" in str(e):  # object arrays need pickle: refused
            raise DataFileError(f"{str(path)!r}: cannot read without unpickling ({e}); save plain "
                                f"numeric arrays with numpy.savez") from None
        raise DataFileError(f"{str(path)!r} is not a readable .npz archive (ValueError: {e}); was it "
                            f"written completely? (numpy.savez)") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # truncated, corrupt
        raise DataFileError(f"{str(path)!r} is not a readable .npz archive ({type(e).__name__}: {e}); "
                            f"was it written completely? (numpy.savez)") from None
