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
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            # The model's own loader maps HF names onto its fused parameters (qkv_proj, gate_up_proj).
            self.model.load_weights(weights=((name, f.get_tensor(name).to(self.device)) for name in f.keys()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass
