"""LoRA adapters for the hf engine: several adapters (and the base model) in one batch, as peft computes them.

:class:`LoraSet` holds the adapters loaded for one torch model. An adapter is a PEFT LoRA folder
(``adapter_config.json`` + ``adapter_model.safetensors``), read here without peft: its ``lora_A``/``lora_B``
matrices are checked against the model's ``nn.Linear`` modules and kept with their scaling (``lora_alpha / r``,
``lora_alpha / sqrt(r)`` with ``use_rslora``, ``rank_pattern``/``alpha_pattern`` matched as peft matches them).
Only plain LoRA is served: DoRA and the other LoRA variants, ``modules_to_save``, trained biases, embedding
adapters and the other peft types are refused with a ValueError naming the folder.

Each targeted Linear gets one forward hook (while some loaded adapter targets it; with no adapter loaded the
model has no hook at all). A forward run inside ``with loras.rows(["a", None, "b"]):`` is a batch whose row
0 uses adapter ``a``, row 1 the base model and row 2 adapter ``b``: each hook adds, to the rows of each adapter,
``lora_B(lora_A(x_rows)) * scaling`` -- peft's LoRA forward at inference (dropout is the identity then). Rows
are grouped per adapter (one ``index_select`` and ``index_add_`` per adapter and module; none when every row
uses the same adapter); a batch of base rows only does no work in the hooks.

Low-precision models (float16/bfloat16) get their adapters in float32 and the sum rounded back once, as peft's
``autocast_adapter_dtype`` does. Nothing here caches activations or KV: a KV computed under one adapter is only
reused by whoever holds it (the services key their prefix caches by adapter).

:func:`make_test_adapter` writes a deterministic, real PEFT adapter for the bundled model (needs peft: a dev
dependency; the engine never imports it). ``python -m splitserve.engines.lora make OUT --seed N`` runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from splitserve.engines.base import UnknownAdapter
from splitserve.engines.derive import holds, write_once

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# peft prefixes a saved adapter's keys with the PeftModel's path to the base model
KEY_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)\.weight$")
# LoraConfig fields whose truthy value means something other than plain LoRA at inference (peft 0.21 marks
# the first ones `is_lora_variant`; the rest change which modules or weights an adapter holds)
_VARIANTS = ("use_dora", "velora_config", "alora_invocation_tokens", "monteclora_config", "use_bdlora",
             "arrow_config", "kasa_config", "use_qalora")
_UNSUPPORTED = ("modules_to_save", "trainable_token_indices", "target_parameters", "layer_replication",
                "lora_bias")


@dataclass(frozen=True)
class LoraWeights:
    """One module's adapter: output += (x @ a.T) @ b.T * scaling."""

    a: Tensor  # [r, in_features]
    b: Tensor  # [out_features, r]
    scaling: float


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    modules: dict[str, LoraWeights]  # model module name -> weights

    @property
    def rank(self) -> int:
        return max(w.a.shape[0] for w in self.modules.values())


# one forward's groups: (adapter, the rows using it; None when every row does)
_Plan = list[tuple[Adapter, Tensor | None]]


def _pattern_key(patterns: Sequence[str], key: str) -> str | None:
    """The first pattern that matches the module name ``key`` (peft's ``get_pattern_key``: the pattern matches
    the whole name or a dotted tail of it)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class LoraSet:
    """The LoRA adapters loaded for one model, and the forward hooks that apply them to the rows that use them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._adapters: dict[str, Adapter] = {}
        self._linears: dict[str, nn.Linear] | None = None
        self._hooks: dict[str, Any] = {}  # module name -> hook handle (while some adapter targets the module)
        self._plan: _Plan | None = None  # the current forward's groups; None: no adapter in this forward
        self._rows = 0

    # -- adapters -------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def get(self, name: str) -> Adapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise UnknownAdapter(name, self.names()) from None

    def check(self, name: str | None) -> None:
        """UnknownAdapter (a ValueError) unless ``name`` is None (the base model) or a loaded adapter."""
        if name is not None:
            self.get(name)

    def linears(self) -> dict[str, nn.Linear]:
        if self._linears is None:
            self._linears = {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        return self._linears

    def load(self, name: str, path: str | Path) -> Adapter:
        """Read the PEFT LoRA folder ``path`` as adapter ``name``. ValueError for a name already loaded, a
        folder that is not a plain LoRA adapter of this model (the message names the folder)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, not {name!r}")
        if name in self._adapters:
            raise ValueError(f"adapter {name!r} is loaded already (unload it first)")
        adapter = read_adapter(name, Path(path), self.model, self.linears(), _compute_dtype(_model_dtype(self.model)))
        self._adapters[name] = adapter
        for module in adapter.modules:
            if module not in self._hooks:
                self._hooks[module] = self.linears()[module].register_forward_hook(self._hook(module))
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (UnknownAdapter if it is not loaded); hooks no adapter needs are removed."""
        adapter = self.get(name)
        if self._plan is not None and any(a is adapter for a, _ in self._plan):
            raise ValueError(f"adapter {name!r} is in use by the forward running now")
        del self._adapters[name]
        needed = {m for a in self._adapters.values() for m in a.modules}
        for module in [m for m in self._hooks if m not in needed]:
            self._hooks.pop(module).remove()

    # -- forwards -------------------------------------------------------------------------------------------
    def plan(self, rows: Sequence[str | None]) -> _Plan | None:
        """The groups of rows per adapter (UnknownAdapter for a name not loaded); None when no row has one."""
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(rows):
            if name is not None:
                groups.setdefault(name, []).append(i)
        if not groups:
            return None
        device = _model_device(self.model)
        plan: _Plan = []
        for name, members in groups.items():
            adapter = self.get(name)
            everyone = len(members) == len(rows)
            plan.append((adapter, None if everyone else torch.tensor(members, dtype=torch.long, device=device)))
        return plan

    @contextmanager
    def rows(self, rows: Sequence[str | None]) -> Iterator[None]:
        """Forwards run in this block are batches whose row i uses adapter rows[i] (None: the base model)."""
        plan = self.plan(rows)
        saved = self._plan, self._rows
        self._plan, self._rows = plan, len(rows)
        try:
            yield
        finally:
            self._plan, self._rows = saved

    def _hook(self, module_name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
            plan = self._plan
            if plan is None:
                return None
            x = args[0]
            if x.shape[0] != self._rows:
                raise RuntimeError(f"a forward of {x.shape[0]} rows ran inside loras.rows() of {self._rows} rows")
            for adapter, index in plan:
                weights = adapter.modules.get(module_name)
                if weights is not None:
                    output = _add(output, x, index, weights)
            return output

        return hook


def _add(output: Tensor, x: Tensor, index: Tensor | None, w: LoraWeights) -> Tensor:
    """output with lora_B(lora_A(x)) * scaling added to the rows ``index`` (all rows when None); in place
    unless autograd is recording."""
    xs = x if index is None else x.index_select(0, index)
    if xs.dtype != w.a.dtype:
        xs = xs.to(w.a.dtype)
    delta = F.linear(F.linear(xs, w.a), w.b) * w.scaling
    inplace = not torch.is_grad_enabled()
    if delta.dtype == output.dtype:
        if index is None:
            return output.add_(delta) if inplace else output + delta
        return output.index_add_(0, index, delta) if inplace else output.index_add(0, index, delta)
    # a low-precision model: added in the adapter's float32, rounded once (peft's autocast_adapter_dtype)
    if index is None:
        summed = (output.to(delta.dtype) + delta).to(output.dtype)
        return output.copy_(summed) if inplace else summed
    summed = (output.index_select(0, index).to(delta.dtype) + delta).to(output.dtype)
    return output.index_copy_(0, index, summed) if inplace else output.index_copy(0, index, summed)


def _model_dtype(model: nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _model_device(model: nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _same_as_model(model: nn.Module, key: str, tensor: Tensor) -> bool:
    """Whether ``key`` (``lm_head.base_layer.weight``, ``model.embed_tokens.weight``) names a parameter of the
    model holding exactly ``tensor``."""
    try:
        param = model.get_parameter(key.replace(".base_layer.", "."))
    except AttributeError:
        return False
    return bool(param.shape == tensor.shape and torch.equal(param.detach().cpu(), tensor.to(param.dtype)))


def read_config(path: Path) -> dict[str, Any]:
    """A PEFT adapter folder's config, checked to be plain LoRA that this module serves as peft would."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {path}: {why}")

    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise refuse(f"no {CONFIG_FILE} (not a PEFT adapter folder)") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"unreadable {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type is {config.get('peft_type')!r}; only plain LoRA adapters are served")
    for key in _VARIANTS:
        if config.get(key):
            raise refuse(f"{key}={config[key]!r}: only plain LoRA is served (not DoRA or another LoRA variant)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith("mica"):
        raise refuse("init_lora_weights='mica' is a LoRA variant; only plain LoRA is served")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise refuse(f"{key}={config[key]!r} is not supported (only LoRA matrices on Linear modules)")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config['bias']!r} is not supported (only bias='none': no trained biases)")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise refuse(f"{key} must be a positive number, not {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        value = config.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(v, int | float) and v > 0 for v in value.values()):
            raise refuse(f"{key} must map module patterns to positive numbers, not {value!r}")
    return config


def read_adapter(name: str, path: Path, model: nn.Module, linears: dict[str, nn.Linear],
                 dtype: torch.dtype) -> Adapter:
    """Adapter ``name`` from the PEFT LoRA folder ``path``, for ``model`` whose Linear modules are ``linears``,
    its weights in ``dtype`` on those modules' devices."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def refuse(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {path}: {why}")

    config = read_config(path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise refuse(f"no {WEIGHTS_FILE} (adapters are read from safetensors only)")
    try:
        tensors = load_file(str(file), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise refuse(f"unreadable {WEIGHTS_FILE}: {exc}") from None
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None and _same_as_model(model, key.removeprefix(KEY_PREFIX), tensor):
            continue  # a copy of a base weight peft saves beside the adapter (lm_head targeted): nothing new
        if match is None:
            raise refuse(f"tensor {key!r} is not a LoRA A/B matrix (only plain LoRA on Linear modules is served)")
        module = match["module"].removeprefix(KEY_PREFIX)
        if module not in linears:
            raise refuse(f"tensor {key!r} targets {module!r}, which is not a Linear module of this model")
        pairs.setdefault(module, {})[match["which"]] = tensor
    if not pairs:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA matrices")
    rank_pattern: dict[str, Any] = config.get("rank_pattern") or {}
    alpha_pattern: dict[str, Any] = config.get("alpha_pattern") or {}
    modules: dict[str, LoraWeights] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"{module} has lora_{''.join(ab)} only")
        a, b, linear = ab["A"], ab["B"], linears[module]
        r_key = _pattern_key(list(rank_pattern), module)
        r = int(rank_pattern[r_key] if r_key is not None else config["r"])
        expected_a, expected_b = (r, linear.in_features), (linear.out_features, r)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise refuse(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                         f"Linear({linear.in_features} -> {linear.out_features}) at rank {r} (needs "
                         f"{expected_a} and {expected_b})")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise refuse(f"{module}: LoRA matrices must be floating point, not {a.dtype} / {b.dtype}")
        alpha_key = _pattern_key(list(alpha_pattern), module)
        alpha = float(alpha_pattern[alpha_key] if alpha_key is not None else config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        device = linear.weight.device
        modules[module] = LoraWeights(a.to(device=device, dtype=dtype).contiguous(),
                                      b.to(device=device, dtype=dtype).contiguous(), scaling)
    return Adapter(name, path, modules)


# -- deterministic test adapters ---------------------------------------------------------------------------
MARKER = ".splitserve-lora.json"  # the recipe's parameters: a folder holding the same ones is reused
RECIPE_VERSION = 1  # bump when the recipe changes: existing folders are then made again
DEFAULT_TARGETS = ("q_proj", "v_proj")
DEFAULT_ALPHA = 8


def recipe(seed: int, r: int, alpha: int, target_modules: Sequence[str]) -> dict[str, Any]:
    from splitserve.engines.model_files import BUNDLED_FILE

    return {"version": RECIPE_VERSION, "base": BUNDLED_FILE, "seed": seed, "r": r, "lora_alpha": alpha,
            "target_modules": sorted(target_modules), "init": "seeded kaiming-uniform A and B (no training)"}


def is_made(out: Path, **params: Any) -> bool:
    return holds(out, MARKER, recipe(**params))


def make_test_adapter(out: Path, *, seed: int, r: int = 8, alpha: int = DEFAULT_ALPHA,
                      target_modules: Sequence[str] = DEFAULT_TARGETS) -> Path:
    """Write a real PEFT LoRA adapter for the bundled SmolLM2 into ``out`` and return ``out``.

    Made with peft from the bundled model's HF folder: ``LoraConfig(init_lora_weights=False)`` initialises
    both A and B (kaiming-uniform, as nn.Linear) from ``torch.manual_seed(seed)``; no training. The same
    parameters give the same weights; different seeds give adapters whose greedy output differs from the
    base model's and from each other's while staying text (at the default rank and alpha). Atomic (a temp
    folder renamed into place); nothing is done when ``out`` holds this recipe already, a folder of another
    recipe is replaced, anything else at ``out`` is left alone (FileExistsError). Needs peft (a dev extra)."""
    out = Path(out).expanduser().absolute()
    params: dict[str, Any] = {"seed": seed, "r": r, "alpha": int(alpha), "target_modules": tuple(target_modules)}
    if r < 1 or alpha <= 0 or not target_modules:
        raise ValueError(f"r must be >= 1, alpha > 0 and target_modules non-empty, not {r}, {alpha}, "
                         f"{list(target_modules)}")
    return write_once(out, MARKER, recipe(**params),
                      lambda tmp: _make(tmp, seed, r, int(alpha), list(target_modules)), "a test adapter folder")


def _make(out: Path, seed: int, r: int, alpha: int, target_modules: list[str]) -> None:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RuntimeError("making a test adapter needs peft (pip install peft; it is in the dev extra)") from None
    from transformers import AutoModelForCausalLM

    from splitserve.engines.hf_export import ensure_hf_folder
    from splitserve.engines.model_files import BUNDLED_FILE

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = ensure_hf_folder(None, dtype="float32")
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
                        init_lora_weights=False, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # leaves the caller's RNG as it was
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
    # the folder's own path on this machine would make the config differ between machines
    model.peft_config["default"].base_model_name_or_path = BUNDLED_FILE
    model.save_pretrained(str(out), safe_serialization=True, save_embedding_layers=False)
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card stub: nothing in it for a test adapter


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m splitserve.engines.lora")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a deterministic test LoRA adapter for the bundled model")
    make.add_argument("out", type=Path)
    make.add_argument("--seed", type=int, required=True)
    make.add_argument("--rank", type=int, default=8)
    make.add_argument("--alpha", type=int, default=DEFAULT_ALPHA)
    make.add_argument("--target", action="append", default=None, help="a module to adapt (repeatable)")
    args = parser.parse_args(argv)
    params: dict[str, Any] = {"seed": args.seed, "r": args.rank, "alpha": args.alpha,
                              "target_modules": tuple(args.target or DEFAULT_TARGETS)}
    if is_made(args.out, **params):
        print(f"{args.out}: made already")
        return
    make_test_adapter(args.out, **params)
    print(f"{args.out}: made")


if __name__ == "__main__":
    main()
