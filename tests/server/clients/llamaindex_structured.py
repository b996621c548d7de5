"""LlamaIndex's ``OpenAIResponses.structured_predict`` against a server, unchanged but for its
base URL: run by ``tests/server/test_llamaindex.py`` in its own environment
(``.venv-llamaindex``: LlamaIndex's OpenAI package needs ``openai<3``, the project's tests run
``openai`` 3). Prints the parsed object as JSON."""

from __future__ import annotations

import json
import sys

from llama_index.core.prompts import PromptTemplate
from llama_index.llms.openai import OpenAIResponses
from pydantic import BaseModel


class Capital(BaseModel):
    city: str
    country: str


def main(base_url: str, model: str) -> None:
    llm = OpenAIResponses(
        model=model, api_base=base_url, api_key="unused", temperature=0.0,
        max_output_tokens=48, context_window=8192, max_retries=0,
    )
    prompt = PromptTemplate("What is the capital of {country}? Answer with the city and country.")
    # structured_predict sends none of the LLM's sampling settings: greedy through llm_kwargs
    capital = llm.structured_predict(
        Capital, prompt, llm_kwargs={"temperature": 0.0}, country="France"
    )
    print(json.dumps(capital.model_dump()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
