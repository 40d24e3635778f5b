"""vLLM generating with the trained LoRA adapter itself: `vllm_lora_sync="adapter"`.

In the merged mode (`gigpo_trl.weight_sync`) every weight sync hands vLLM each adapted layer's merged weight and
every other weight of the model: the whole model after every update, gathered whole under ZeRO-3, and impossible for
a quantized base (QLoRA), which cannot be merged. In the adapter mode vLLM is started with LoRA enabled (its rank from
the PEFT config) and holds the base weights it loaded at start, which never change; each sync writes the current
adapter (PEFT's own files: `adapter_config.json`, `adapter_model.safetensors`) to a new folder of a temporary
directory and loads it into the engine as a new version (vLLM loads adapters from disk), and every generation names
the latest version. Under ZeRO-3 only the adapter's parameters are gathered.

vLLM colocate only: TRL 1.16's server client names no adapter in its requests and moves weights by NCCL broadcast
(its `/update_weights`), and vLLM's server loads adapters from a path of its own machine; the server mode is refused
by `GiGPOConfig`.

The colocated engine is started here too, for both modes: `vllm_engine_for` adds the adapter mode's LoRA arguments and
the user's `vllm_engine_kwargs` to TRL's `LLM(...)` call.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear

from gigpo_trl.weight_sync import lora_layers, merge_disabled, sync_lora_out_of_place

if TYPE_CHECKING:
    from trl.generation.vllm_generation import VLLMGeneration

    from gigpo_trl.config import GiGPOConfig

# The ranks vLLM's LoRA kernels are built for (vLLM's `LoRAConfig.max_lora_rank`, `MaxLoRARanks`, vLLM 0.31): the
# engine is started with the smallest of them that holds the adapter's rank.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# LoraConfig fields whose effect an adapter loaded by vLLM would not have (vLLM's PEFT reader ignores or refuses them),
# with the value that has no effect.
ADAPTER_FIELDS_VLLM_IGNORES = {
    "bias": ("none", "trains the base model's biases, which the adapter files do not carry"),
    "lora_bias": (False, "a bias on lora_B, which vLLM refuses"),
    "modules_to_save": (None, "trains full copies of these modules, which vLLM's adapters cannot carry"),
    "trainable_token_indices": (None, "trains embedding rows, which vLLM's adapters cannot carry"),
    "rank_pattern": ({}, "per-layer ranks: vLLM scales every layer by lora_alpha / r"),
    "alpha_pattern": ({}, "per-layer alphas: vLLM scales every layer by lora_alpha / r"),
    "target_parameters": (None, "adapts parameters (MoE experts), not linear layers"),
    "layer_replication": (None, "repeats layers, which vLLM's model does not"),
    "alora_invocation_tokens": (None, "activated LoRA, which vLLM does not apply"),
}


def adapter_lora_config(model: Any, peft_config: Any) -> LoraConfig:
    """The LoRA config of the adapter the adapter mode serves: `peft_config` (the trainer's argument) or the config of
    `model`'s active adapter (a `PeftModel`). Raises ValueError for a model without a LoRA adapter, or a config whose
    adapter vLLM could not apply as trained (`ADAPTER_FIELDS_VLLM_IGNORES`, a rank above vLLM's largest)."""
    if peft_config is None and isinstance(model, PeftModel):
        if len(model.active_adapters) != 1:
            raise ValueError(f"vllm_lora_sync='adapter' serves one adapter; the model has {len(model.active_adapters)} "
                             f"active ({model.active_adapters})")
        peft_config = model.peft_config[model.active_adapter]
    if peft_config is None:
        raise ValueError(
            "vllm_lora_sync='adapter' hands vLLM a LoRA adapter, and this model has none: pass a peft_config "
            "(peft.LoraConfig; use_peft in the recipes) or a PeftModel, or use vllm_lora_sync='merged' (the default), "
            "which syncs a fully trained model")
    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"vllm_lora_sync='adapter' serves LoRA adapters only (vLLM's LoRA); got a "
                         f"{type(peft_config).__name__}: use vllm_lora_sync='merged' or use_vllm=False")
    problems = [f"{name}={value!r} ({why})" for name, (neutral, why) in ADAPTER_FIELDS_VLLM_IGNORES.items()
                if (value := getattr(peft_config, name, neutral)) != neutral and value]
    if peft_config.use_dora:
        problems.append("use_dora=True (vLLM has no DoRA)")
    if peft_config.r > VLLM_MAX_LORA_RANKS[-1]:
        problems.append(f"r={peft_config.r} is above {VLLM_MAX_LORA_RANKS[-1]}, the largest rank vLLM's LoRA takes")
    if problems:
        raise ValueError("vllm_lora_sync='adapter': vLLM would not generate with this adapter as trained: "
                         f"{'; '.join(problems)}. Change the LoraConfig, or use vllm_lora_sync='merged'")
    return peft_config


def engine_lora_rank(rank: int) -> int:
    """The `max_lora_rank` vLLM is started with for an adapter of rank `rank`: the smallest vLLM takes that holds it."""
    return next(allowed for allowed in VLLM_MAX_LORA_RANKS if allowed >= rank)


@contextmanager
def vllm_engine_for(args: GiGPOConfig, model: Any, peft_config: Any) -> Iterator[None]:
    """Inside the block, the colocated engine TRL builds (`VLLMGeneration._init_vllm`, from `GRPOTrainer.__init__`)
    is started with `args.vllm_engine_kwargs` and for the weight sync `args.vllm_lora_sync` chose: with LoRA enabled
    for the adapter of `model` / `peft_config` in the adapter mode (TRL's `LLM(...)` call takes neither: they are
    added to it for the block); as TRL starts it otherwise. Before anything is loaded, a 4-bit base is refused where vLLM could not generate
    with its adapter (`quantized_base_problem`). Nothing changes without vLLM."""
    if not args.use_vllm:
        yield
        return
    problem = quantized_base_problem(args, model)
    if problem:
        raise ValueError(problem)
    added = dict(args.vllm_engine_kwargs or {})
    if args.vllm_lora_sync == "adapter":
        config = adapter_lora_config(model, peft_config)
        added.update(enable_lora=True, max_lora_rank=engine_lora_rank(config.r), max_loras=1)
    if not added:
        yield
        return
    from trl.generation import vllm_generation  # noqa: PLC0415 (imports vLLM)

    engine = vllm_generation.LLM

    def engine_with_added_arguments(*engine_args: Any, **kwargs: Any) -> Any:
        return engine(*engine_args, **added, **kwargs)

    vllm_generation.LLM = engine_with_added_arguments
    try:
        yield
    finally:
        vllm_generation.LLM = engine


def quantized_base_problem(args: GiGPOConfig, model: Any) -> str | None:
    """Why vLLM could not generate with a LoRA adapter on the 4-bit (bitsandbytes) base of `model` (a loaded model, or
    a name loaded with `args.model_init_kwargs`), or None (no 4-bit base, or nothing in the way). The merged mode
    cannot merge into 4-bit weights; the adapter mode needs vLLM to load the base in 4 bits as the trainer does (TRL
    starts the engine with quantization='bitsandbytes'), which vLLM's later releases dropped."""
    quantization = (args.model_init_kwargs or {}).get("quantization_config") if isinstance(model, str) else None
    four_bit = (getattr(model, "is_loaded_in_4bit", False) if not isinstance(model, str) else
                bool(quantization.get("load_in_4bit") if isinstance(quantization, dict)
                     else getattr(quantization, "load_in_4bit", False)))
    if not four_bit:
        return None
    if args.vllm_lora_sync == "merged":
        return ("a 4-bit (bitsandbytes) base cannot take a merged adapter, and vllm_lora_sync='merged' merges it into "
                "the base for every sync: use vllm_lora_sync='adapter' (vLLM keeps its own 4-bit base and gets the "
                "adapter alone), or use_vllm=False")
    import vllm  # noqa: PLC0415
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS  # noqa: PLC0415

    if "bitsandbytes" not in QUANTIZATION_METHODS:
        return (f"a 4-bit (bitsandbytes) base needs vLLM to load the base in 4 bits as the trainer does (TRL starts the "
                f"engine with quantization='bitsandbytes'), and vLLM {vllm.__version__} has no bitsandbytes "
                f"quantization (its methods: {', '.join(QUANTIZATION_METHODS)}): train QLoRA with use_vllm=False "
                "(generation by transformers), or with a vLLM release that has bitsandbytes")
    return None


def install_weight_sync(generation: VLLMGeneration, mode: str) -> AdapterSync | None:
    """Make TRL's vLLM backend sync a PEFT model in `mode` (`VLLM_LORA_SYNC_MODES`): 'merged', the merged weights
    computed out of place (`gigpo_trl.weight_sync`; nothing changes for a model without adapters), or 'adapter'
    (`AdapterSync`, returned)."""
    if mode == "adapter":
        return AdapterSync(generation)
    sync_lora_out_of_place(generation)
    return None


class AdapterSync:
    """The adapter mode's weight sync of TRL's colocated vLLM backend (see the module docstring): it replaces the
    backend's `sync_weights`, and its engine's `generate` is made to name the latest adapter version.

    Raises ValueError at construction for an engine that cannot hold the adapter (started without LoRA, or with a
    smaller max_lora_rank than the adapter's rank), and for an adapted layer vLLM cannot adapt: a PEFT layer other
    than LoRA's linear layers (plain or 4-bit), or a module the engine has no LoRA layer for (an embedding, the LM
    head, ...).
    """

    def __init__(self, generation: VLLMGeneration) -> None:
        if generation.mode != "colocate":
            raise ValueError("vllm_lora_sync='adapter' runs with vllm_mode='colocate' only")
        if generation._dist.is_fsdp:
            raise ValueError("vllm_lora_sync='adapter' gathers the adapter under DeepSpeed ZeRO-3, not FSDP: use "
                             "DeepSpeed, or vllm_lora_sync='merged' (which refuses FSDP too) with use_vllm=False")
        self.generation = generation
        self.model: PeftModel = generation.model
        self.adapter_name = self.model.active_adapter
        self.engine = generation.llm
        engine_lora = self.engine.llm_engine.vllm_config.lora_config
        rank = self.model.peft_config[self.adapter_name].r
        if engine_lora is None or engine_lora.max_lora_rank < rank:
            started = "without LoRA" if engine_lora is None else f"with max_lora_rank={engine_lora.max_lora_rank}"
            raise ValueError(f"vllm_lora_sync='adapter': the vLLM engine was started {started}, and the adapter's rank "
                             f"is {rank}: vLLM cannot load it. GiGPOTrainer starts its engine for the adapter it trains "
                             "(vllm_engine_for); an engine started otherwise needs enable_lora=True and "
                             f"max_lora_rank >= {rank}")
        problems = unadaptable_layers(self.model, engine_lora_modules(self.engine))
        if problems:
            raise ValueError(f"vllm_lora_sync='adapter': vLLM cannot adapt these layers of the model: {'; '.join(problems)}. "
                             "Leave them out of the LoraConfig's target_modules, or use vllm_lora_sync='merged'")
        self._folder = tempfile.TemporaryDirectory(prefix="gigpo-trl-adapter-")
        self.version = 0  # of the latest adapter loaded into the engine (0: none yet)
        self.request = None  # its vLLM LoRARequest
        self.last_sync_bytes = 0  # the size of the latest adapter's files
        self._push_weights = generation.sync_weights  # TRL's: every weight of the model, merged
        generation.sync_weights = self.sync
        generate = self.engine.generate

        def generate_with_adapter(*args: Any, **kwargs: Any) -> Any:
            if self.request is None:
                raise RuntimeError("vLLM was asked to generate before the adapter was synced (TRL syncs before every "
                                   "first generation of a step)")
            return generate(*args, lora_request=self.request, **kwargs)

        self.engine.generate = generate_with_adapter

    def sync(self) -> None:
        """Load the current adapter into the engine as a new version and drop the previous one. An engine woken from
        sleep mode's level-2 sleep, which discards its weights, first gets the base weights again (TRL's sync with the
        adapter left unmerged)."""
        from vllm.lora.request import LoRARequest  # noqa: PLC0415

        generation = self.generation
        if generation.enable_sleep_mode and generation._llm_weights_sleeping:
            with merge_disabled(self.model):
                self._push_weights()  # wakes the weights up, loads the base weights, resets the prefix cache
        version = self.version + 1
        folder = Path(self._folder.name, f"v{version}")
        self.last_sync_bytes = write_adapter(self.model, self.adapter_name, folder,
                                             gather=generation._dist.gather_params)
        request = LoRARequest(f"gigpo-adapter-v{version}", version, str(folder))
        self.engine.llm_engine.add_lora(request)  # loaded now, not at the next generation
        if self.request is not None:
            self.engine.llm_engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.request.lora_path)
        self.version, self.request = version, request
        self.engine.reset_prefix_cache()


def write_adapter(model: PeftModel, adapter_name: str, folder: str | os.PathLike, gather=None) -> int:
    """Write the adapter `adapter_name` of `model` to `folder` as PEFT saves it (`adapter_config.json` and
    `adapter_model.safetensors`, loadable by `PeftModel.from_pretrained` and by vLLM); `gather(params)`, a context
    manager (TRL's `gather_params`: DeepSpeed ZeRO-3), gathers the adapter's parameters, and only those, while they are
    read. Returns the size of the tensors written, in bytes."""
    from safetensors.torch import save_file  # noqa: PLC0415

    adapter = [param for name, param in model.named_parameters() if f".{adapter_name}." in name and "lora_" in name]
    with (gather or (lambda params: nullcontext()))(adapter):
        state = {name: tensor.detach().to("cpu", copy=True).contiguous()
                 for name, tensor in get_peft_model_state_dict(model, adapter_name=adapter_name).items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config[adapter_name].save_pretrained(str(folder))
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def engine_lora_modules(engine: Any) -> set[str]:
    """The module names (last name part, as PEFT's target_modules, e.g. 'q_proj') vLLM's colocated engine applies
    adapters to: its LoRA layers, with its fused layers (qkv_proj, ...) unpacked into what they fuse, as vLLM's own
    adapter loader (`WorkerLoRAManager._load_adapter`) computes it."""
    manager = engine.llm_engine.model_executor.driver_worker.model_runner.lora_manager._adapter_manager
    modules = set()
    for module in manager.supported_lora_modules:
        modules.update(manager.packed_modules_mapping.get(module, [module]))
    return modules


def unadaptable_layers(model: PeftModel, engine_modules: set[str]) -> list[str]:
    """The adapted layers of `model` vLLM cannot apply an adapter to, by name and reason: a PEFT layer other than
    LoRA's linear layers (plain or bitsandbytes 4-bit), a LoRA variant (DoRA, ...), or a module whose name is not
    among `engine_modules` (`engine_lora_modules`)."""
    plain, problems = lora_layers(
        model, lambda module: isinstance(module, LoraLinear) or type(module).__name__ == "Linear4bit",
        ": vLLM adapts linear layers only")
    for name in plain:
        module = name.rsplit(".", 1)[-1]
        if module not in engine_modules:
            problems.append(f"{name} (the engine has no LoRA layer for '{module}'; it adapts "
                            f"{', '.join(sorted(engine_modules))})")
    return problems
