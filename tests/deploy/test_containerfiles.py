"""The Containerfiles' shape, read as a builder reads them (the console image is also built and
run by test_console_image.py with IMAGE_TESTS=1; the CUDA agent image is built by
scripts/build_images.sh on a machine with the bandwidth, not here): multi-stage, the base and
the vLLM version as build arguments, the result without build tools, non-root, with a health
command and an entry point the deployment files use."""

from __future__ import annotations

import re

import pytest
from django.conf import settings

from tests.deploy.known import DEPLOY, entrypoint_commands

FILES = ["Containerfile", "Containerfile.agent"]
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|make|build-essential|python3-dev|python3-venv|"
                         r"pip install)\b")


def stages(name: str) -> list[list[tuple[str, str]]]:
    """Each stage's instructions as (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / name).read_text())
    result: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, arguments = line.strip().partition(" ")
        if instruction == "FROM":
            result.append([])
        result[-1].append((instruction, arguments))
    return result


@pytest.mark.parametrize("name", FILES)
def test_the_result_is_a_later_stage_on_the_base_argument_without_build_tools(name):
    preamble, *built = stages(name)
    assert ("ARG", next(a for i, a in preamble if a.startswith("BASE_IMAGE="))) in preamble
    assert len(built) >= 2
    result = built[-1]
    assert result[0] == ("FROM", "${BASE_IMAGE}")
    assert any(i == "COPY" and a.startswith("--from=build ") for i, a in result)
    runs = " ".join(a for i, a in result if i == "RUN")
    assert not BUILD_TOOLS.search(runs), runs


@pytest.mark.parametrize("name", FILES)
def test_the_result_runs_as_a_user_with_its_health_command_and_entry_point(name):
    result = dict(stages(name)[-1])
    assert result["USER"] not in {"root", "0"}
    assert result["HEALTHCHECK"].endswith('CMD ["llm-console", "healthcheck"]')
    assert result["ENTRYPOINT"] == '["llm-console"]'
    command = re.fullmatch(r'\["([\w-]+)"\]', result["CMD"]).group(1)
    assert command in entrypoint_commands() and "healthcheck" in entrypoint_commands()


def test_the_agent_image_takes_the_vllm_version_and_package():
    arguments = [a for i, a in stages("Containerfile.agent")[0] if i == "ARG"]
    assert {a.split("=")[0] for a in arguments} >= {"BASE_IMAGE", "VLLM_VERSION", "VLLM_PACKAGE"}
    build = " ".join(a for i, a in stages("Containerfile.agent")[1] if i == "RUN")
    assert '"${VLLM_PACKAGE}==${VLLM_VERSION}"' in build


@pytest.mark.parametrize("name", FILES)
def test_every_project_app_is_copied_into_the_image(name):
    """An app in INSTALLED_APPS that the image lacks stops every process of it at start."""
    copied = {arguments.split()[0] for stage in stages(name)
              for instruction, arguments in stage if instruction == "COPY"}
    project_apps = {app for app in settings.INSTALLED_APPS if app.endswith("_app")}
    assert project_apps - copied == set()
