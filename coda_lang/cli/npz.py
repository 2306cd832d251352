"""Reading `coda run --inputs`: an .npz archive of arrays by parameter name, any malformed file refused.

What it does: `read_npz(path, memory)` reads the arrays of an archive that `np.savez` (or
`np.savez_compressed`) wrote, by name, checking before it allocates anything: that the file is a zip
archive (not empty, not one bare .npy array, not a pickle), that every member is an .npy array of
plain elements (no Python objects, which only unpickling could read), that each member holds the bytes
its header declares, and that all of them fit in `memory` bytes. Anything else is a `BadInputs`
whose text is one line saying what is wrong with the file.
What it does not: check the arrays against a block's parameters (interp/inputs.py's `bind`: E08).
Invariants: nothing is ever unpickled; no NumPy or zipfile message reaches the user untranslated
(NumPy's advice to load with `allow_pickle` never does); an array is allocated only after its
header was checked against the member's size and the memory.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from typing import Any

NPY_MAGIC = b"\x93NUMPY"
HINT = "--inputs takes an .npz archive of arrays by parameter name: np.savez(path, x=..., w=...)"


class BadInputs(Exception):
    """A file `--inputs` can't take; str() is the one-line reason (without the path)."""


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n:,} bytes"


def read_npz(path: str, memory: int) -> dict[str, Any]:
    """The arrays of the .npz archive at `path` by name; OSError when it can't be opened, BadInputs
    when it is not such an archive or its arrays need more than `memory` bytes."""
    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    import numpy as np
    from numpy.lib import format as npy

    with open(path, "rb") as f:
        head = f.read(len(NPY_MAGIC))
        if not head:
            raise BadInputs(f"the file is empty; {HINT}")
        if head.startswith(NPY_MAGIC):
            raise BadInputs(f"the file is one .npy array, not an archive; {HINT}")
        if head[:1] == b"\x80":
            raise BadInputs("the file holds pickled Python objects, which coda never loads; " + HINT)
        if not head.startswith(b"PK"):
            raise BadInputs(f"the file is not an .npz (zip) archive; {HINT}")
        f.seek(0)
        try:
            with zipfile.ZipFile(f) as z:
                return _members(z, memory, np, npy)
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
            raise BadInputs(f"the archive is damaged ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text.rstrip(".")


def _members(z: zipfile.ZipFile, memory: int, np: Any, npy: Any) -> dict[str, Any]:
    infos = z.infolist()
    names: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in infos:
        if info.is_dir():
            continue
        if not info.filename.endswith(".npy"):
            raise BadInputs(f"member `{info.filename}` is not an array (.npy); {HINT}")
        name = info.filename[: -len(".npy")]
        if name in names:
            raise BadInputs(f"the archive holds `{name}` twice")
        names[name] = info
        with z.open(info) as m:
            try:
                version = npy.read_magic(m)
                if version == (1, 0):
                    shape, _, dtype = npy.read_array_header_1_0(m)
                elif version == (2, 0):
                    shape, _, dtype = npy.read_array_header_2_0(m)
                else:
                    raise ValueError(f".npy format version {version[0]}.{version[1]}")
                if any(n < 0 for n in shape):
                    raise ValueError(f"a negative extent in its shape {tuple(shape)}")
            except (ValueError, EOFError, SyntaxError, TypeError) as e:
                raise BadInputs(f"member `{info.filename}` is not an .npy array ({_reason(e)})") from None
            start = m.tell()
        if dtype.hasobject:
            raise BadInputs(
                f"member `{name}` holds Python objects (pickled), which coda never loads; "
                "arrays of numbers only"
            )
        need = math.prod(shape) * dtype.itemsize
        held = info.file_size - start
        if need > held:
            raise BadInputs(
                f"member `{name}` declares a {dtype} array of shape {tuple(shape)} ({_size(need)}), "
                f"but holds {_size(max(held, 0))}"
            )
        total += need
    if total > memory:
        raise BadInputs(f"its arrays need {_size(total)}; {_size(memory)} are available")
    out: dict[str, Any] = {}
    for name, info in names.items():
        with z.open(info) as m:
            try:
                out[name] = npy.read_array(m, allow_pickle=False)
            except (ValueError, OSError) as e:
                raise BadInputs(f"member `{name}` can't be read ({_reason(e)})") from None
    return out
