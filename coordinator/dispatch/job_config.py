"""What a job builds its task loop from: the loop's settings, the model step's environment,
and the envelope charge of each call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis

from overnight.config.settings import gateway_base
from overnight.coordinator.dispatch.gateway_probe import gateway_wanted
from overnight.coordinator.report.logs import task_log_root
from overnight.coordinator.tasks.charge import asked_again
from overnight.coordinator.tasks.loop import CallRefused, Consume, LoopConfig
from overnight.coordinator.workspace.hostdirs import prompt_root
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty

if TYPE_CHECKING:
    from overnight.config.settings import Settings


def model_env(settings: Settings) -> dict[str, str]:
    """The model settings the built-in model step needs, passed to it alone."""
    env = {
        "OVERNIGHT_MODEL_NAME": settings.model_name,
        "OVERNIGHT_MODEL_TIMEOUT": repr(settings.model_timeout),
    }
    if settings.model_url:
        env["OVERNIGHT_MODEL_URL"] = settings.model_url
    if settings.model_api_key:
        env["OVERNIGHT_MODEL_API_KEY"] = settings.model_api_key.get_secret_value()
    return env


def loop_config(settings: Settings, namespace: str) -> LoopConfig:
    return LoopConfig(
        model_env=model_env(settings),
        preset_models={"openai": settings.model_name, "anthropic": settings.anthropic_model},
        gateway_url=gateway_base(settings) if gateway_wanted(settings) else None,
        default_deadline=settings.deadline,
        default_gap=settings.heartbeat_gap,
        grace=settings.grace,
        claim_ttl=settings.task_claim_ttl,
        max_lost_leases=settings.max_lost_leases,
        prompt_dir=prompt_root(settings, namespace),
        log_dir=task_log_root(settings, namespace),
    )


def envelope_consume(
    client: redis.Redis, namespace: str, task_id: str, settings: Settings
) -> Consume:
    """Charge the shared envelope named by the task (acknowledged by the replicas the settings
    ask for); an empty one raises CallRefused."""
    from overnight.config.connection import wait_replicas

    envelopes: dict[str, CallEnvelope] = {}
    replicas = wait_replicas(settings)

    def consume(name: str, kind: str, request_id: str) -> None:
        if name not in envelopes:
            envelopes[name] = CallEnvelope(
                client,
                name,
                namespace,
                request_ttl=settings.request_id_ttl,
                task_id=task_id,
                replicas=replicas,
                replica_timeout=settings.redis_wait_timeout,
            )
        envelope = envelopes[name]
        try:
            # Under its request id a consume asked again gets its first answer: it is
            # retried while Redis cannot answer (a stall, a failover, a replica behind).
            asked_again(lambda: envelope.try_consume(kind, request_id=request_id), name)
        except EnvelopeEmpty as exc:
            raise CallRefused("envelope", f"shared envelope {name!r}: {exc}") from None

    return consume
