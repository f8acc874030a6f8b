"""Adapter files: tensor data checked against the safetensors header, deleted adapters' files
removed only once no engine has them, and the node agent leaving out adapters that would stop a
shared engine."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from serving_app import storage
from serving_app.engine.adapters import usable_adapters
from serving_app.modelfiles import ModelFilesError, check_safetensors, read_adapter
from serving_app.models import AdapterFileRemoval, Instance, LoraAdapter
from tests.factories import make_adapter, make_adapter_dir, make_deployment, make_tenant

State = Instance.State


def _safetensors(path: Path, header: dict, data_bytes: int) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


def _f32(shape: list[int], begin: int) -> dict:
    n = 4
    for dim in shape:
        n *= dim
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + n]}


class TestTensorData:
    def test_a_well_formed_file_passes(self, tmp_path):
        header = {"a": _f32([2, 4], 0), "b": _f32([4, 2], 32)}
        assert set(check_safetensors(_safetensors(tmp_path / "x", header, 64))) == {"a", "b"}

    @pytest.mark.parametrize(("header", "data", "message"), [
        ({"a": _f32([2, 4], 0)}, 16, "truncated or has trailing data"),  # cut short
        ({"a": _f32([2, 4], 0)}, 48, "truncated or has trailing data"),  # padded
        ({"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 16]}}, 16,
         "dtype and shape need 32"),
        ({"a": _f32([2, 4], 0), "b": _f32([2, 4], 16)}, 48, "overlaps"),
        ({"a": _f32([2, 4], 8)}, 40, "leaves a gap"),
        ({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}}, 0, "invalid shape"),
        ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 2]}}, 2, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [2]}}, 8, "invalid data offsets"),
    ])
    def test_tensor_data_that_does_not_match_the_header_is_refused(self, tmp_path, header,
                                                                   data, message):
        with pytest.raises(ModelFilesError, match=message):
            check_safetensors(_safetensors(tmp_path / "x", header, data))

    def test_an_adapter_with_corrupt_tensor_data_is_refused(self, tmp_path):
        folder = make_adapter_dir(tmp_path)
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])  # the header alone still reads fine
        with pytest.raises(ModelFilesError, match="truncated"):
            read_adapter(str(folder))

    def test_content_errors_do_not_name_the_host_path(self, tmp_path):
        (tmp_path / "empty").mkdir()
        with pytest.raises(ModelFilesError) as info:
            read_adapter(str(tmp_path / "empty"))
        assert str(tmp_path) not in str(info.value) and not info.value.host_path


def _uploaded(tenant, base_model, name: str = "notes") -> LoraAdapter:
    """An adapter whose files lie in the tenant's storage area, as an upload leaves them."""
    folder = make_adapter_dir(storage.tenant_area(tenant.pk), f"{name}-0123abcd")
    adapter = LoraAdapter(tenant=tenant, base_model=base_model, name=name, path=str(folder))
    adapter.full_clean()
    adapter.save()
    return adapter


@pytest.mark.django_db
class TestFilesOfDeletedAdapters:
    def test_files_go_only_once_no_engine_has_the_adapter(self, base_model):
        tenant = make_tenant("t-del")
        adapter = _uploaded(tenant, base_model)
        deployment = make_deployment(base_model, [tenant], adapters=[adapter])
        instance = Instance.objects.create(deployment=deployment, state=State.READY,
                                           loaded_adapters=[adapter.engine_name])
        folder = Path(adapter.path)
        adapter.delete()
        assert AdapterFileRemoval.objects.get().path == str(folder)
        assert AdapterFileRemoval.objects.remove_released() == 0
        assert folder.is_dir()  # still loaded in a running engine
        # The node agent unloaded it at runtime.
        Instance.objects.filter(pk=instance.pk).update(loaded_adapters=[])
        assert AdapterFileRemoval.objects.remove_released() == 1
        assert not folder.exists()
        assert folder.parent.is_dir()  # the tenant's area stays
        assert AdapterFileRemoval.objects.remove_released() == 0  # idempotent

    def test_a_starting_engine_given_the_path_keeps_the_files(self, base_model):
        tenant = make_tenant("t-start")
        adapter = _uploaded(tenant, base_model)
        deployment = make_deployment(base_model, [tenant])
        Instance.objects.create(deployment=deployment, state=State.STARTING,
                                command=["python", "--lora-modules",
                                         f"{adapter.engine_name}={adapter.path}"])
        adapter.delete()
        assert AdapterFileRemoval.objects.remove_released() == 0
        Instance.objects.update(state=State.STOPPED)
        assert AdapterFileRemoval.objects.remove_released() == 1

    def test_files_under_a_model_root_are_never_removed(self, base_model, tmp_path):
        adapter = make_adapter(make_tenant("t-root"), base_model, tmp_path / "platform")
        adapter.delete()
        assert not AdapterFileRemoval.objects.exists()
        assert Path(adapter.path).is_dir()

    def test_deleting_a_tenant_removes_its_uploaded_files(self, base_model):
        tenant = make_tenant("t-gone")
        folder = Path(_uploaded(tenant, base_model).path)
        tenant.delete()
        assert AdapterFileRemoval.objects.remove_released() == 1
        assert not folder.exists()

    def test_a_removal_never_reaches_outside_the_tenant_area(self, tmp_path):
        assert storage.removable(str(tmp_path)) is None
        assert storage.removable(str(storage.tenant_area(5))) is None
        assert storage.removable(str(storage.tenant_area(5) / "x")) is not None
        assert storage.removable(str(storage.tenant_area(5) / ".." / ".." / "etc")) is None


@pytest.mark.django_db
class TestAdaptersAnEngineStartsWith:
    def test_bad_adapters_are_left_out_with_their_error(self, base_model, tmp_path):
        tenant, other = make_tenant("t-a"), make_tenant("t-b")
        good = make_adapter(tenant, base_model, tmp_path / "g", "good")
        wide = make_adapter(other, base_model, tmp_path / "r", "wide-rank", rank=8)
        corrupt = make_adapter(other, base_model, tmp_path / "c", "corrupt")
        deployment = make_deployment(base_model, [tenant, other],
                                     adapters=[good, wide, corrupt], max_lora_rank=8)
        # Their files changed on disk after they were registered.
        make_adapter_dir(tmp_path / "r2", "x", rank=16)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            Path(wide.path, name).write_bytes((tmp_path / "r2" / "x" / name).read_bytes())
        weights = Path(corrupt.path, "adapter_model.safetensors")
        weights.write_bytes(weights.read_bytes()[:-8])
        instance = Instance.objects.create(deployment=deployment, state=State.STARTING)
        adapters, errors = usable_adapters(instance, tmp_path / "engine.log",
                                          instance.engine_spec())
        assert adapters == [good]
        assert "rank 16 is above the deployment's max_lora_rank 8" in errors[wide.engine_name]
        assert "truncated" in errors[corrupt.engine_name]
        wide.refresh_from_db()
        assert wide.last_error == errors[wide.engine_name]
        assert "left out" in (tmp_path / "engine.log").read_text()

    def test_an_adapter_whose_folder_is_gone_gets_the_generic_message(self, base_model,
                                                                       tmp_path):
        tenant = make_tenant("t-c")
        adapter = make_adapter(tenant, base_model, tmp_path / "g", "gone")
        deployment = make_deployment(base_model, [tenant], adapters=[adapter])
        for file in Path(adapter.path).iterdir():
            file.unlink()
        Path(adapter.path).rmdir()
        instance = Instance.objects.create(deployment=deployment, state=State.STARTING)
        adapters, errors = usable_adapters(instance, tmp_path / "engine.log",
                                          instance.engine_spec())
        assert adapters == []
        assert errors[adapter.engine_name].endswith(storage.GENERIC_PATH_ERROR)
        assert str(tmp_path) not in errors[adapter.engine_name]
        assert "is not a folder" in (tmp_path / "engine.log").read_text()  # for the operator
