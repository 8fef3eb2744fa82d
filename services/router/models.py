"""The models a router serves: each one's name, files, tokenizer and queue pool, and which workers serve it.

A router serves one model or several (``--model NAME=PATH``, repeatable; the first is the default for a request
that names none). Each worker serves one model and names it in its heartbeat (``Heartbeat.model``, its
``--served-model-name``). With several models a request is routed only among the workers that announce its
model, waits in its model's queue lanes (``proto.model_pool``), and its prefix-cache salt is scoped to the model
(no cache hit across models). With one model every worker is that model's (whatever name it announces: a mock
or vLLM worker names the same files differently), and a request may name it by the router's name or by the name
its decoders announce (intake; an unknown name is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.proto import Heartbeat, model_pools

if TYPE_CHECKING:
    from splitserve.services.router.tokenize import PromptTokenizer

BUNDLED = "bundled"  # a --model PATH that names the bundled model
MAX_NAME = 256  # GenerateRequest.model's bound: a longer name could never be asked for


ModelPolicies = dict[str, tuple[str | None, int | None]]  # model -> (its strategy, its disaggregation threshold)


def parse_model_policies(strategies: list[str], thresholds: list[str]) -> ModelPolicies:
    """``--model-strategy NAME=STRATEGY`` and ``--model-disagg-threshold NAME=TOKENS`` (each repeatable) -> the
    settings of each model that has its own; ValueError naming the argument at fault."""
    out: dict[str, tuple[str | None, int | None]] = {}
    for flag, args in (("--model-strategy", strategies), ("--model-disagg-threshold", thresholds)):
        for arg in args:
            name, sep, value = arg.rpartition("=")  # a model name may hold '=' nowhere, a strategy never
            name, value = name.strip(), value.strip()
            if not sep or not name or not value:
                raise ValueError(f"{flag} {arg!r}: give NAME=VALUE")
            strategy, threshold = out.get(name, (None, None))
            if flag == "--model-strategy":
                strategy = value
            else:
                try:
                    threshold = int(value)
                except ValueError:
                    raise ValueError(f"{flag} {arg!r}: the threshold is a whole number of tokens") from None
            out[name] = (strategy, threshold)
    return out


def parse_model_arg(arg: str | None) -> tuple[str | None, str | None]:
    """``--model`` as given: ``NAME=PATH`` -> (NAME, PATH); ``PATH`` -> (None, PATH) (the name is then the
    tokenizer's: the files' name); ``bundled`` or None -> the bundled model. A PATH holding ``=`` needs a NAME."""
    if arg is None:
        return None, None
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = "", arg
    name, path = name.strip(), path.strip()
    if sep and not name:
        raise ValueError(f"--model {arg!r}: the name before '=' is empty")
    if len(name) > MAX_NAME:
        raise ValueError(f"--model {arg!r}: a model name has at most {MAX_NAME} characters")
    return (name or None), (None if not path or path.lower() == BUNDLED else path)


@dataclass
class ServedModel:
    name: str
    ref: str | None  # what --model named (None: the bundled model)
    pool: str  # its queue lanes' subject token (proto.model_pools: "default" when it is the only one)
    tokenizer: PromptTokenizer | None = None  # loaded at the router's setup (ModelTable.load_tokenizers)

    @property
    def tok(self) -> PromptTokenizer:
        assert self.tokenizer is not None, "the router's setup loads the tokenizers"
        return self.tokenizer


class ModelTable:
    """The served models, looked up by name, and the model each worker serves."""

    def __init__(self, args: list[str | None] | None = None) -> None:
        """From the ``--model`` arguments (none: the bundled model). Names only: files are located (a bare PATH
        is named by its files, as its workers name it), tokenizers are loaded later (``load_tokenizers``)."""
        from splitserve.engines.model_files import resolve_model

        parsed = []
        for arg in args or [None]:
            name, ref = parse_model_arg(arg)
            parsed.append((name or resolve_model(ref).name, ref))
        names = [name for name, _ in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        models = [ServedModel(name=name, ref=ref, pool=pool)
                  for (name, ref), pool in zip(parsed, model_pools(names), strict=True)]
        self.models = models
        self.default = models[0]
        self.single = len(models) == 1
        self._by_name = {m.name: m for m in models}

    def load_tokenizers(self) -> None:
        """Each model's tokenizer (blocking: a few tenths of a second each)."""
        from splitserve.services.router.tokenize import PromptTokenizer

        for m in self.models:
            if m.tokenizer is None:
                m.tokenizer = PromptTokenizer(m.ref)

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def check_policies(self, policies: ModelPolicies) -> ModelPolicies:
        """``policies`` if every model they name is served here, every strategy is known and every threshold is
        >= 0; else ValueError saying which."""
        from splitserve.routing.registry import available

        for name, (strategy, threshold) in policies.items():
            if name not in self._by_name:
                raise ValueError(f"per-model routing settings for {name!r}: {self.not_found(name)}")
            if strategy is not None and strategy not in available():
                raise ValueError(f"model {name!r}: unknown routing strategy {strategy!r}; available: "
                                 f"{', '.join(available())}")
            if threshold is not None and threshold < 0:
                raise ValueError(f"model {name!r}: the disaggregation threshold must be >= 0, not {threshold}")
        return dict(policies)

    def resolve(self, name: str | None) -> ServedModel | None:
        """The model a request asks for: none named -> the default; with one model, any name is it; else None
        for a name not served."""
        if not name or self.single:
            return self.default
        return self._by_name.get(name)

    def named(self, name: str) -> ServedModel | None:
        """The served model of exactly that name."""
        return self._by_name.get(name)

    def served(self, name: str | None) -> ServedModel:
        """The model of a request already admitted (its ``model`` was resolved at intake; an older message
        without one is the default's)."""
        return self._by_name.get(name or "", self.default)

    def model_of(self, hb: Heartbeat) -> str | None:
        """The served model a worker's heartbeat belongs to (None: a model this router does not serve)."""
        if self.single:
            return self.default.name
        return hb.model if hb.model in self._by_name else None

    def not_found(self, name: str) -> str:
        return f"model {name!r} is not served here; served models: {', '.join(self.names())}"
