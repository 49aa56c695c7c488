"""Generated files are written to a temporary folder first and put in place
only once the whole run has succeeded, so a run that fails (a missing
package, an assertion, Ctrl-C) leaves the committed files as they were.

    with staged(OUT, replace_all=True) as tmp:
        ...write every file under tmp...
    # here OUT holds exactly this run's files (plus any non-matching ones)

    with staged_file(OUT) as tmp:
        ...write one file at tmp...
    # here OUT is that file
"""

import os
import shutil
import tempfile
from contextlib import contextmanager


@contextmanager
def staged(final_dir, *, replace_all=False, suffix=".safetensors"):
    """Yields a fresh temporary folder beside `final_dir` (same file system,
    so moving its entries is a rename). When the block finishes, each entry
    written there replaces the one of the same name in `final_dir` (a
    folder replaces a folder whole); with `replace_all`, the `suffix` files
    of `final_dir` that this run did not write are removed too. When the
    block raises, the temporary folder is removed and `final_dir` is not
    touched."""
    final_dir = os.path.abspath(final_dir)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}-staging-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.makedirs(final_dir, exist_ok=True)
    written = sorted(os.listdir(tmp))
    if replace_all:
        for name in os.listdir(final_dir):
            if name.endswith(suffix) and name not in written:
                os.remove(os.path.join(final_dir, name))
    for name in written:
        dest = os.path.join(final_dir, name)
        if os.path.isdir(dest) and not os.path.islink(dest):
            shutil.rmtree(dest)
        os.replace(os.path.join(tmp, name), dest)
    os.rmdir(tmp)


@contextmanager
def staged_file(final_path):
    """Yields a temporary path beside `final_path` (same file system). When
    the block finishes, the file written there replaces `final_path` (a
    rename); when it raises, the temporary file is removed and
    `final_path` is not touched."""
    final_path = os.path.abspath(final_path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(final_path), suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, final_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
