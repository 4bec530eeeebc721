"""The fleet's routes, on every sidecar: the fleet view, and approvals routed to the owner.

Sidecars that share a state database see each other's changes, but only the sidecar holding a
job drives its changes (``tuner._fleet``). So an approval or rejection made on any sidecar's
fleet page goes to the job's owner, over the owner's own API, with the operator's bearer token
and name: the owner checks the token, moves the change and writes the operator into its audit
trail, exactly as if the operator had called it. An owner that does not answer is a 502 that
says which sidecar is down; nothing is decided for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException

from dashboards import fleet_view
from seedancectl._api import (
    ApproveBody,
    ReasonBody,
    api_errors,
    bearer_token,
    change_json,
    check_token,
)
from seedancectl._api_client import SidecarClient, SidecarError
from tuner import Change, Credentials, FleetDirectory, RolloutController, RolloutError

if TYPE_CHECKING:
    from seedancectl._sidecar import Sidecar

FORWARD_TIMEOUT_S = 10.0
"""How long a routed approval waits for the owning sidecar."""

Forward = Callable[[SidecarClient], Any]
Local = Callable[[RolloutController], Change]


def fleet_router(sidecar: Sidecar) -> APIRouter:
    """``GET /v1/fleet`` and ``POST /v1/fleet/changes/{id}/approve`` | ``/reject``."""
    router = APIRouter(prefix="/v1/fleet", tags=["fleet"])
    config = sidecar.config

    @router.get("")
    def fleet() -> dict[str, Any]:
        """Every job of the fleet (``dashboards.fleet_view``); ``me`` is this sidecar."""
        view = fleet_view(config.state_db, heartbeat_s=config.fleet_heartbeat_s)
        return {**view.to_json(), "me": sidecar.fleet.sidecar_id}

    def route(change_id: str, credentials: Credentials, verb: str, forward: Forward,
              local: Local) -> dict[str, Any]:
        token = bearer_token(credentials)
        controller = sidecar.controller
        if controller is None or not sidecar.started:
            raise HTTPException(503, "the sidecar is starting or stopping")
        try:
            job = controller.get(change_id).job
        except RolloutError:
            raise HTTPException(404, f"no change {change_id!r} in the fleet") from None
        with FleetDirectory(config.state_db, heartbeat_s=config.fleet_heartbeat_s) as fleet:
            held = fleet.job(job)
        me = {"sidecar_id": sidecar.fleet.sidecar_id, "url": sidecar.fleet.url}
        if held is None or held.owner_id == sidecar.fleet.sidecar_id:
            check_token(sidecar, credentials)
            with api_errors():
                return {**change_json(local(controller)), "routed_to": me}
        owner = held.owner
        if owner is None:
            raise HTTPException(502, f"job {job} is held by sidecar {held.owner_id}, which left "
                                     f"the fleet: the change was not {verb}")
        try:
            with SidecarClient(owner.url, token=token, timeout_s=FORWARD_TIMEOUT_S) as client:
                moved = forward(client)
        except SidecarError as exc:
            if exc.status is not None:  # the owner answered: its refusal, as it said it
                raise HTTPException(exc.status, f"sidecar {owner.sidecar_id} (owner of job "
                                                f"{job}): {exc}") from None
            down = "" if owner.alive else " (its heartbeat is stale: it is down)"
            raise HTTPException(502, f"sidecar {owner.sidecar_id} at {owner.url}, which holds "
                                     f"job {job}, does not answer{down}: the change was not "
                                     f"{verb}") from None
        return {**moved, "routed_to": {"sidecar_id": owner.sidecar_id, "url": owner.url}}

    @router.post("/changes/{change_id}/approve")
    def approve(change_id: str, body: ApproveBody, credentials: Credentials) -> dict[str, Any]:
        """Approve on the sidecar that holds the change's job."""
        return route(
            change_id, credentials, "approved",
            lambda client: client.approve(change_id, by=body.by, comment=body.comment),
            lambda controller: controller.approve(change_id, body.by, body.comment))

    @router.post("/changes/{change_id}/reject")
    def reject(change_id: str, body: ReasonBody, credentials: Credentials) -> dict[str, Any]:
        """Reject on the sidecar that holds the change's job."""
        return route(
            change_id, credentials, "rejected",
            lambda client: client.reject(change_id, by=body.by, reason=body.reason),
            lambda controller: controller.reject(change_id, body.by, body.reason))

    return router


__all__ = ["FORWARD_TIMEOUT_S", "fleet_router"]
