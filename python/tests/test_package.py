"""The package's surface: the stubs name what the extension holds, and the package is
typed."""

from __future__ import annotations

import ast
from pathlib import Path

import aurora_rl
from aurora_rl import _core

PACKAGE = Path(aurora_rl.__file__).parent


def test_the_stubs_name_exactly_what_the_extension_holds():
    tree = ast.parse((PACKAGE / "_core.pyi").read_text())
    stubbed = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stubbed.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stubbed.add(node.target.id)
    stubbed = {name for name in stubbed if not name.startswith("_")}
    held = {name for name in dir(_core) if not name.startswith("_")}
    assert stubbed == held


def test_the_package_is_typed_and_exports_what_it_documents():
    assert (PACKAGE / "py.typed").exists()
    assert sorted(aurora_rl.__all__) == sorted(name for name in aurora_rl.__all__ if hasattr(aurora_rl, name))
    assert aurora_rl.FORMAT_VERSION >= 1


def test_vllm_loads_the_plugin_in_its_processes():
    """vLLM's own loader finds the plugin (entry point ``vllm.general_plugins``), and after
    it this process may use AMX tiles wherever the CPU has them."""
    import torch
    from vllm.plugins import load_plugins_by_group

    from aurora_rl import vllm_plugin

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins.get("aurora") is vllm_plugin.register
    plugins["aurora"]()
    if torch.cpu._is_amx_tile_supported():
        # Granted already: asking again is answered yes at once.
        assert torch._C._cpu._init_amx()
