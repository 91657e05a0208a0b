"""langchain-tests' standard suites for ``ChatSpecDec`` (pinned: langchain-tests==1.1.9),
in local mode on the demo pair ``smollm2-135m`` (SmolLM2-135M-Instruct; the pair loads
once per process, ~3 s from the conversion cache). Capabilities the model does not have
(tool calling, structured output, JSON mode, images, audio, PDFs) are declared through the
suites' properties, so those tests skip themselves; no test is edited or skipped by hand."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from specdec_llm.langchain import ChatSpecDec

pytestmark = pytest.mark.smollm2

# few tokens keep the suite quick (~25 tok/s on 2 CPU cores); greedy; nothing written to the store
PARAMS = {"pair": "smollm2-135m", "backend": "local", "max_new_tokens": 24, "record": False}


class _Declared:
    """What ChatSpecDec can and cannot do, for both suites."""

    @property
    def chat_model_class(self) -> type[ChatSpecDec]:
        return ChatSpecDec

    @property
    def chat_model_params(self) -> dict:
        return dict(PARAMS)

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True


# The suites' async tests carry no asyncio mark (they expect pytest-asyncio's auto mode):
# a class mark runs them; sync tests ignore it (its warning about them is filtered).
_ASYNC = [pytest.mark.asyncio, pytest.mark.filterwarnings("ignore:The test .* is marked with '@pytest.mark.asyncio'")]


class TestChatSpecDecUnit(_Declared, ChatModelUnitTests):
    pytestmark = _ASYNC


class TestChatSpecDecIntegration(_Declared, ChatModelIntegrationTests):
    pytestmark = _ASYNC
