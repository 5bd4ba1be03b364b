"""The fleet's refusals: each says what was wrong, and its status is the API's answer."""

from controlpanel.registry.errors import InvalidTransition, ServiceError

__all__ = [
    "InvalidModelSetting",
    "InvalidPolicy",
    "InvalidTokenizer",
    "InvalidTransition",
    "InvalidWeight",
    "InvalidWorkerKey",
    "InvalidWorkerRole",
    "InvalidWorkerURL",
    "LastRoutableWorker",
    "NotAVllmServer",
    "RequestLoop",
    "ServiceError",
    "WorkerAlreadyExists",
    "WorkerUnreachable",
]


class InvalidWorkerURL(ServiceError):
    status = 422


class InvalidWorkerKey(ServiceError):
    status = 422


class InvalidWorkerRole(ServiceError):
    status = 422


class WorkerUnreachable(ServiceError):
    status = 422


class NotAVllmServer(ServiceError):
    status = 422


class WorkerAlreadyExists(ServiceError):
    status = 409


class InvalidPolicy(ServiceError):
    status = 422


class InvalidTokenizer(ServiceError):
    """A tokenizer folder the routers could not load (kv_aware's local tokenizer)."""

    status = 422


class InvalidWeight(ServiceError):
    status = 422


class RequestLoop(ServiceError):
    """The URL reaches a router of this deployment: refused before anything is stored."""

    status = 422


class LastRoutableWorker(ServiceError):
    """Draining or removing it leaves a model with no routable worker; `force` overrides."""

    status = 409


class InvalidModelSetting(ServiceError):
    status = 422
