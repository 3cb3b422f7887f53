"""envace's weight transfer backend for a vLLM server: the trainer writes its weights to a
safetensors file, the server's workers load it.

Runs inside `vllm serve` only (the `.venv-vllm` of `make install-vllm`, where envace is
installed with --no-deps); envace's own venv never imports it. vLLM calls `register` in every
process through the `vllm.general_plugins` entry point (pyproject.toml), which adds the backend
"envace_file" to vLLM's own weight transfer registry, and
`vllm serve ... --weight-transfer-config '{"backend": "envace_file"}'` selects it. The trainer
then drives vLLM's native weight update protocol over HTTP (the VLLM_SERVER_DEV_MODE=1 routes):
/init_weight_transfer_engine, /start_weight_update, /update_weights with
`{"update_info": {"path": FILE}}`, /finish_weight_update (see envace/backends/vllm.py).

The file must be readable by the server's workers: the same host, or a filesystem both sides
mount. This module sits outside envace.backends (whose __init__ imports the HF backends) and
imports only vLLM, torch and safetensors, which the server's venv has.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "envace_file"


def register() -> None:
    """vLLM general plugin: make "envace_file" a weight transfer backend in this process."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
    except ValueError:
        pass  # vLLM may load general plugins more than once per process; the first registration stands


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: each update names its file."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file of full weights under the Hugging Face names


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Loads checkpoint-format weights from a safetensors file. As in vLLM's IPC engine, an update
    runs inside vLLM's layerwise reload, so the model's post-load processing (fused or quantized
    layouts) is redone on the new weights."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self._loaded: set[str] = set()

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            # The model's own loader maps HF names onto its fused parameters (qkv_proj, gate_up_proj).
            self.model.load_weights(weights=((name, f.get_tensor(name).to(self.device)) for name in names))
        self._loaded = getattr(self, "_loaded", set()) | set(names)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_unloaded_cpu_gemms(self.model, getattr(self, "_loaded", set()))
        self._loaded = set()

    def shutdown(self) -> None:
        pass


def repack_unloaded_cpu_gemms(model, loaded: set[str]) -> list[str]:
    """Re-pack, from their current weights, the CPU GEMMs of layers that keep their weight but
    took none from this update (returns their names).

    vLLM's CPU backend gives every linear layer a `cpu_linear` built from its weight once loaded
    (oneDNN or sgl-kernel pack a copy). An LM head tied to the input embeddings has no tensor of its
    own in the file (tied tensors are written once, as the embedding), so vLLM's layerwise reload
    leaves that layer's packed copy at the weights it was started with: the shared weight is new,
    but the logits would still come from the old one. On a GPU no layer has `cpu_linear`: nothing
    to do."""
    repacked = []
    for prefix, module in model.named_modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if (hasattr(module, "cpu_linear") and method is not None and getattr(weight, "ndim", 0) == 2 and weight.numel()
                and f"{prefix}.weight" not in loaded):
            method.process_weights_after_loading(module)
            repacked.append(prefix)
    return repacked
