"""Capacity reservations and Capacity Blocks for ML: the reservation a job launches into, checked before
anything is created (`check_capacity`, called by preflight) and described in the plan (`Capacity`).

An On-Demand Capacity Reservation (ODCR) bills at the On-Demand rate whether instances use it or not; a
Capacity Block (ReservationType "capacity-block") is paid upfront when reserved and ends hard. Either way
the instances launch in the reservation's zone only, targeted by id (provision.py's launch template).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from trainyard.errors import ConfigError
from trainyard.sdk.backends.ec2.network import error_code

# EC2 begins terminating a Capacity Block's instances 30 minutes before the block ends (EC2 User Guide,
# "Work with Capacity Blocks"): a job in a block has until then
CAPACITY_BLOCK_EARLY_END_S = 30 * 60
# how long before a scheduled Capacity Block's start fit() may be called: the launch waits in fit() itself,
# which should block minutes, not the hours or days a block can be bought ahead
CAPACITY_BLOCK_START_WAIT_S = 30 * 60


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """The capacity reservation a job launches into (JobSpec.capacity_reservation_id), as
    DescribeCapacityReservations reported it to preflight."""

    reservation_id: str
    block: bool
    """A Capacity Block for ML (ReservationType "capacity-block"): paid upfront, ends hard."""
    zone: str
    state: str
    """"active", or "scheduled" (a Capacity Block that has not begun: the launch waits for it)."""
    total: int
    available: int
    match: str
    """InstanceMatchCriteria: "targeted" or "open" (the launch targets the reservation by id either way)."""
    start: datetime | None
    end: datetime | None
    """None: an On-Demand Capacity Reservation without an end date."""

    @property
    def kind(self) -> str:
        return "Capacity Block" if self.block else "On-Demand Capacity Reservation"

    def describe(self, instance_type: str) -> str:
        """The plan's `capacity:` line: which reservation, its window (UTC) and what it costs the job."""
        when = (f"{_utc(self.start)} to {_utc(self.end)} UTC" if self.end else
                f"from {_utc(self.start)} UTC, no end date")
        state = self.state
        if self.state == "scheduled":
            left = (self.start - datetime.now(timezone.utc)).total_seconds() / 3600 if self.start else 0.0
            state = f"scheduled: begins in {max(left, 0.0):.1f} h, and the launch waits for it"
        match = "" if self.block else f" ({self.match})"
        price = ("paid upfront when it was reserved, so the job adds $0/hour here" if self.block else
                 "billed at the On-Demand rate whether instances use it or not, so the cost below is that rate, "
                 "not an extra")
        return (f"{self.kind} {self.reservation_id}{match} in {self.zone}: {self.available} of {self.total} x "
                f"{instance_type} available, {when} ({state}); {price}")


def _utc(t: datetime | None) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M") if t else "now"



def check_capacity(ec2, spec, zones: dict[str, str], subnets: list[tuple[str | None, str]], notes: list,
                    warnings: list) -> tuple[Capacity | None, list[tuple[str | None, str]]]:
    """The reservation of `capacity_reservation_id` (DescribeCapacityReservations): it exists, reserves the
    instance type on Linux/UNIX with default tenancy outside a placement group, has room for instance_count,
    is active (or is a Capacity Block yet to begin) and lasts through max_run (a warning for a Capacity Block,
    whose instances are terminated at its end; a note for an On-Demand Capacity Reservation, whose instances
    keep running outside it). Returns it and the launch candidates narrowed to its zone."""
    from botocore.exceptions import BotoCoreError, ClientError

    rid, field_ = spec.capacity_reservation_id, "capacity_reservation_id"
    if not rid:
        return None, subnets
    region = ec2.meta.region_name
    try:
        found = ec2.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
    except (ClientError, BotoCoreError) as e:
        if not error_code(e).startswith("InvalidCapacityReservationId"):
            raise ConfigError(field_, f"{rid} could not be read in {region} ({error_code(e)}); checking it needs "
                              "ec2:DescribeCapacityReservations") from None
        found = []
    if not found:
        raise ConfigError(field_, f"capacity reservation {rid} not found in {region}: check the id and the region "
                          "(a reservation, Capacity Blocks included, serves its own region and zone; one of another "
                          "account must be shared with this one)")
    r = found[0]
    block = r.get("ReservationType") == "capacity-block"
    kind = "Capacity Block" if block else "On-Demand Capacity Reservation"
    what = f"{kind} {rid}"
    zone, state = r.get("AvailabilityZone", ""), r.get("State", "")
    start, end = r.get("StartDate"), r.get("EndDate")
    now = datetime.now(timezone.utc)
    if r.get("InstanceType") != spec.instance_type:
        raise ConfigError(field_, f"{what} reserves {r.get('InstanceType')}, and the job asks for "
                          f"{spec.instance_type}: pass instance_type='ml.{r.get('InstanceType')}', or a reservation of "
                          f"{spec.instance_type}")
    if state != "active" and not (block and state == "scheduled"):
        why = {"expired": "it has ended", "cancelled": "it was cancelled", "scheduled": "it has not begun",
               "payment-pending": "its payment is being processed", "payment-failed": "its payment failed"}
        since = f" (from {_utc(start)} UTC)" if state == "scheduled" and start else ""
        raise ConfigError(field_, f"{what} is {state}{since}: {why.get(state, 'it cannot take instances now')}; the "
                          "job needs an active reservation, or a Capacity Block that is active or scheduled")
    if r.get("InstancePlatform") != "Linux/UNIX":
        raise ConfigError(field_, f"{what} is for {r.get('InstancePlatform')} instances; the job's AMI is "
                          "Linux/UNIX: use a Linux/UNIX reservation")
    if r.get("Tenancy", "default") != "default":
        raise ConfigError(field_, f"{what} has {r.get('Tenancy')} tenancy; the job launches default-tenancy "
                          "instances: use a reservation with default tenancy")
    if r.get("PlacementGroupArn"):
        raise ConfigError(field_, f"{what} is reserved in the placement group {r['PlacementGroupArn']}, and the "
                          "job launches into a cluster placement group of its own, which that capacity does not "
                          "serve: use a reservation outside placement groups")
    available, total = r.get("AvailableInstanceCount", 0), r.get("TotalInstanceCount", 0)
    if available < spec.instance_count:
        raise ConfigError(field_, f"{what} has {available} of its {total} x {spec.instance_type} available "
                          f"({total - available} in use), and the job needs {spec.instance_count}: lower "
                          "instance_count, or free (terminate) instances running in it")
    if zone not in zones:
        raise ConfigError(field_, f"{what} is in {zone}, where {spec.instance_type} is not offered "
                          f"(offered in {', '.join(zones)})")
    if spec.subnets:  # a reservation's instances launch in its zone only
        zone_of = {s["SubnetId"]: s["AvailabilityZone"]
                   for s in ec2.describe_subnets(SubnetIds=list(spec.subnets))["Subnets"]}
        elsewhere = [f"{s} ({zone_of.get(s, 'unknown zone')})" for s in spec.subnets if zone_of.get(s) != zone]
        if elsewhere:
            raise ConfigError("subnets", f"{', '.join(elsewhere)} not in {zone}, the zone of {what}: its instances "
                              f"launch there only; pass subnets in {zone}, or omit subnets (one is created there)")
        subnets = [(s, z) for s, z in subnets if z == zone]
    else:
        subnets = [(None, zone)]
    if state == "scheduled" and start is not None and (start - now).total_seconds() > CAPACITY_BLOCK_START_WAIT_S:
        raise ConfigError(field_, f"{what} begins at {_utc(start)} UTC, in {(start - now).total_seconds() / 3600:.1f} "
                          f"h: call fit() at most {CAPACITY_BLOCK_START_WAIT_S // 60} minutes before it begins (the "
                          "launch waits that long for it)")
    begins = max(now, start) if start else now
    if end is not None:
        last = end - timedelta(seconds=CAPACITY_BLOCK_EARLY_END_S) if block else end
        hours = (last - begins).total_seconds() / 3600
        if block and hours <= 0:
            raise ConfigError(field_, f"{what} ends at {_utc(end)} UTC, and EC2 terminates its instances from "
                              f"{_utc(last)} UTC on: no job can run in it now")
        if begins + timedelta(seconds=spec.max_run) > last and block:
            warnings.append(f"{what} ends at {_utc(end)} UTC and EC2 begins terminating its instances 30 minutes "
                            f"earlier: the job will be stopped after about {hours:.1f} h, before max_run "
                            f"({spec.max_run / 3600:g} h) is up; checkpoint to checkpoint_s3_uri to resume elsewhere, "
                            "or lower max_run")
        elif begins + timedelta(seconds=spec.max_run) > last:
            notes.append(f"{what} ends at {_utc(end)} UTC, before max_run ({spec.max_run / 3600:g} h) is up: the "
                         "instances keep running past it as ordinary On-Demand instances, outside reserved capacity")
    return Capacity(reservation_id=rid, block=block, zone=zone, state=state, total=total, available=available,
                    match=r.get("InstanceMatchCriteria", "targeted"), start=start, end=end), subnets
