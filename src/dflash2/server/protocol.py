"""Request bodies (OpenAI and SGLang shapes), validated by pydantic."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingFields(_Base):
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    stream: bool = False


class GenerateSampling(_Base):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None


class GenerateRequest(_Base):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
