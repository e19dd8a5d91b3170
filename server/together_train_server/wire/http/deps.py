"""What an HTTP route is handed, typed: FastAPI dependencies over the one holder `create_app` sets.

Routes never read ``app.state`` for the service: a route declares ``resource: ResourceDep`` (the
service's face, `service.interfaces.ResourceApi`), ``svc: InferenceDep`` (the OpenAI-style
`InferenceService`), ``chats: ChatsDep`` (the chat use case, `Chats`) and ``owner: OwnerDep`` (the
caller's owner tag, set by the app's authentication), or calls `resource_of` / `inference_of` /
`chats_of` / `owner_of` in a package's request context. The API packages' own tables (Tinker's and
Together's ids) stay theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from together_train_server.service.errors import ServiceError
from together_train_server.service.interfaces import Chats, InferenceService, ResourceApi

__all__ = ["ChatsDep", "InferenceDep", "OwnerDep", "ResourceDep", "Services", "chats_of", "inference_of", "owner_of",
           "resource_of", "services_of"]


@dataclass
class Services:
    """The served objects of one app (``app.state.services``).

    Attributes:
        resource: the resource's face (``deploy`` serves its `Deployment` instead: the OpenAI routes only).
        inference: the OpenAI-style service (set by the OpenAI package's ``install``; None without it).
        chats: the chat use case over `inference` (set with it).
    """

    resource: Any
    inference: InferenceService | None = None
    chats: Chats | None = None


def services_of(app: Any) -> Services:
    """The app's `Services` (set by `app.create_app`)."""
    services = app.state.services
    assert isinstance(services, Services)
    return services


def resource_of(request: Request) -> ResourceApi:
    """The service's face for a route (a FastAPI dependency: `ResourceDep`)."""
    resource: ResourceApi = services_of(request.app).resource
    return resource


def inference_of(request: Request) -> InferenceService:
    """The app's `InferenceService` (a FastAPI dependency: `InferenceDep`).

    Raises:
        ServiceError: UNIMPLEMENTED when the app serves no OpenAI API.
    """
    svc = services_of(request.app).inference
    if svc is None:
        raise ServiceError("UNIMPLEMENTED", "this server serves no inference API")
    return svc


def chats_of(request: Request) -> Chats:
    """The app's chat use case (`service.sampling.chat.Chats`; a FastAPI dependency: `ChatsDep`).

    Raises:
        ServiceError: UNIMPLEMENTED when the app serves no OpenAI API.
    """
    chats = services_of(request.app).chats
    if chats is None:
        raise ServiceError("UNIMPLEMENTED", "this server serves no inference API")
    return chats


def owner_of(request: Request) -> str:
    """The caller's owner tag: its API key ("" without keys; set by the app's authentication)."""
    return str(getattr(request.state, "owner", ""))


ResourceDep = Annotated[ResourceApi, Depends(resource_of)]
InferenceDep = Annotated[InferenceService, Depends(inference_of)]
ChatsDep = Annotated[Chats, Depends(chats_of)]
OwnerDep = Annotated[str, Depends(owner_of)]
