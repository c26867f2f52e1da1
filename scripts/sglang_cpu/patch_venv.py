"""Patches the CPU SGLang venv so SGLang runs there (test-only, CPU-only; never on GPUs).

Run with the venv's python: ``.venv-sglang/bin/python scripts/sglang_cpu/patch_venv.py``.
Idempotent: each patch leaves a marker and is skipped when the marker is there.
Fails, naming the file, when the text to patch is missing (a different version).

1. torchvision: the PyPI wheel for torch 2.13 is a CUDA build whose compiled ops
   cannot load beside CPU torch, and registering fake kernels for the missing
   ``torchvision::nms`` / ``qnms`` ops raises at import. Register them only when
   the compiled ops loaded, as torchvision already does for its other ops.
2. SGLang ``--enable-return-routed-experts``: the host buffer for captured routes
   is pinned memory, which needs CUDA. Pin it only when CUDA is there.
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig

MARKER = "# jaxrl CPU test-only patch"
SITE = pathlib.Path(sysconfig.get_paths()["purelib"])

PATCHES = [
    (
        "torchvision/_meta_registrations.py",
        [
            ('@torch.library.register_fake("torchvision::nms")',
             f'@_register_fake_if_ops("torchvision::nms")  {MARKER}'),
            ('@torch.library.register_fake("torchvision::qnms")',
             f'@_register_fake_if_ops("torchvision::qnms")  {MARKER}'),
            ("\n\n@functools.lru_cache(None)\ndef get_meta_lib():",
             f"\n\ndef _register_fake_if_ops(op_name):  {MARKER}\n"
             "    if torchvision.extension._has_ops():\n"
             "        return torch.library.register_fake(op_name)\n"
             "    return lambda fn: fn\n"
             "\n\n@functools.lru_cache(None)\ndef get_meta_lib():"),
        ],
    ),
    (
        "sglang/srt/state_capturer/base.py",
        [("            pin_memory=True,\n",
          f"            pin_memory=torch.cuda.is_available(),  {MARKER}\n")],
    ),
]


def main() -> int:
    for relative, replacements in PATCHES:
        path = SITE / relative
        text = path.read_text()
        if MARKER in text:
            continue
        for old, new in replacements:
            if text.count(old) != 1:
                print(f"patch_venv: {path}: expected exactly one {old!r}, found {text.count(old)}; "
                      "the installed version differs from the pinned one "
                      "(scripts/sglang_cpu/requirements-cpu.lock)", file=sys.stderr)
                return 1
            text = text.replace(old, new)
        path.write_text(text)
        print(f"patch_venv: patched {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
