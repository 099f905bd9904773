"""Capacity reservations and Capacity Blocks on the EC2 backend, against the moto server of tests/cloud.

moto 5.2 does not implement capacity reservations, so `DescribeCapacityReservations` is answered by a fake of
our own: a botocore `before-call.ec2.DescribeCapacityReservations` hook on the Estimator's session
(`boto_session=`) that returns a canned reply shaped as the real API's (field names and types of botocore's
model; dates as botocore parses them, aware datetimes in UTC), or raises the real API's
`InvalidCapacityReservationId.NotFound` for an id it does not hold. Everything else (zones, subnets, the role,
the image, the launch) is moto's. The reservation is put in the second zone that offers the type, so a plan
that keeps only its zone is told apart from the default (the first zone). What moto drops at launch (the
launch template's CapacityReservationSpecification and market type) is read from the request through the
`Recorder` of tests/cloud/conftest.py.
"""
from datetime import datetime, timedelta, timezone

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError

from trainyard.errors import ConfigError
from trainyard.sdk.backends.ec2.preflight import prices

from .conftest import IMAGE, Recorder, leftovers

ODCR, BLOCK = "cr-0123456789abcdef0", "cr-0fedcba98765432a1"
HOUR = timedelta(hours=1)


class Reservations:
    """DescribeCapacityReservations answered on `session` from `rows` (moto has no capacity reservations)."""

    def __init__(self, session, *rows: dict):
        self.rows = {r["CapacityReservationId"]: r for r in rows}
        self.asked: list[list[str]] = []
        session.events.register("before-call.ec2.DescribeCapacityReservations", self)

    def __call__(self, params, **_):
        body = params.get("body", {})
        ids = [v for k, v in sorted(body.items()) if k.startswith("CapacityReservationId.")]
        self.asked.append(ids)
        missing = [i for i in ids if i not in self.rows]
        if missing:  # the real API's answer for an id it does not know
            raise ClientError({"Error": {"Code": "InvalidCapacityReservationId.NotFound",
                                         "Message": f"The capacity reservation ID '{missing[0]}' does not exist"}},
                              "DescribeCapacityReservations")
        rows = [self.rows[i] for i in ids] if ids else list(self.rows.values())
        return AWSResponse("http://fake-capacity-reservations", 200, {}, None), {"CapacityReservations": rows}


def zones(itype: str) -> list[tuple[str, str]]:
    """(zone, zone id) of the zones of us-east-1 that offer `itype`, in name order."""
    ec2 = boto3.client("ec2")
    offered = {o["Location"] for o in ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [itype]}])["InstanceTypeOfferings"]}
    return sorted((z["ZoneName"], z["ZoneId"]) for z in ec2.describe_availability_zones()["AvailabilityZones"]
                  if z["ZoneName"] in offered)


def reservation(rid: str = ODCR, *, block: bool = False, itype: str = "p4d.24xlarge", total: int = 4,
                available: int | None = None, state: str = "active", start: datetime | None = None,
                end: datetime | None = None, zone: tuple[str, str] | None = None, **over) -> dict:
    """One CapacityReservations item as DescribeCapacityReservations returns it."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    zone_name, zone_id = zone or zones(itype)[1]
    start = start or now - HOUR
    row = {
        "CapacityReservationId": rid, "OwnerId": "123456789012",
        "CapacityReservationArn": f"arn:aws:ec2:us-east-1:123456789012:capacity-reservation/{rid}",
        "AvailabilityZoneId": zone_id, "InstanceType": itype, "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": zone_name, "Tenancy": "default", "TotalInstanceCount": total,
        "AvailableInstanceCount": total if available is None else available, "EbsOptimized": True,
        "EphemeralStorage": False, "State": state, "StartDate": start,
        "EndDateType": "limited" if end or block else "unlimited",
        "InstanceMatchCriteria": "targeted" if block else "open", "CreateDate": start - HOUR, "Tags": [],
        "CapacityAllocations": [], "ReservationType": "capacity-block" if block else "default",
        "DeliveryPreference": "fixed",
    }
    if end or block:
        row["EndDate"] = end or start + 48 * HOUR
    if block:
        row["CapacityBlockId"] = "cb-0123456789abcdef0"
    return {**row, **over}


def _estimator(account, rec: Recorder, instance_type="ml.p4d.24xlarge", count=2, **kw):
    from trainyard import Estimator

    return Estimator(entry_point="trainyard.engine.train", instance_type=instance_type, instance_count=count,
                     hyperparameters={"steps": 2, "global_batch_size": 64, "micro_batch_size": 1},
                     output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"],
                     boto_session=rec.session, **kw)


def _utc(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M")


def test_an_odcr_pins_the_zone_and_bills_at_the_on_demand_rate(account, capsys):
    rec = Recorder()
    row = reservation(total=4, available=3)
    fake = Reservations(rec.session, row)
    plan = _estimator(account, rec, capacity_reservation_id=ODCR).fit(dry_run=True, job_name="odcr")
    zone = row["AvailabilityZone"]
    assert fake.asked == [[ODCR]]
    assert plan.zone == zone and plan.zones_to_try == (zone,) and plan.zone_id == row["AvailabilityZoneId"]
    assert plan.capacity.reservation_id == ODCR and not plan.capacity.block and plan.warnings == ()
    price = prices()["on_demand"]["us-east-1"]["p4d.24xlarge"]
    assert plan.estimated_cost_per_hour == pytest.approx(2 * price)  # the ODCR's own rate: nothing on top
    out = capsys.readouterr().out
    assert "(On-Demand Capacity Reservation) in us-east-1, zone " + zone in out
    assert (f"  capacity:  On-Demand Capacity Reservation {ODCR} (open) in {zone}: 3 of 4 x p4d.24xlarge available, "
            f"from {_utc(row['StartDate'])} UTC, no end date (active); billed at the On-Demand rate whether instances "
            "use it or not") in out
    assert f"${2 * price:,.2f}/hour" in out
    assert rec.created() == []


def test_a_capacity_block_costs_nothing_per_hour_and_a_scheduled_one_is_waited_for(account, capsys):
    rec = Recorder()
    now = datetime.now(timezone.utc).replace(microsecond=0)
    active = reservation(BLOCK, block=True, itype="p5.48xlarge", total=2, start=now - HOUR, end=now + 47 * HOUR)
    fake = Reservations(rec.session, active)
    plan = _estimator(account, rec, "ml.p5.48xlarge", capacity_reservation_id=BLOCK).fit(dry_run=True, job_name="cb")
    zone = active["AvailabilityZone"]
    assert plan.zone == zone and plan.zones_to_try == (zone,)
    assert plan.capacity.block and plan.capacity.state == "active"
    assert plan.estimated_cost_per_hour == 0.0 and plan.estimated_cost_max_run == 0.0 and plan.warnings == ()
    out = capsys.readouterr().out
    assert (f"  capacity:  Capacity Block {BLOCK} in {zone}: 2 of 2 x p5.48xlarge available, "
            f"{_utc(now - HOUR)} to {_utc(now + 47 * HOUR)} UTC (active); paid upfront when it was reserved, so the "
            "job adds $0/hour here") in out
    assert "$0.00/hour for 2 instance(s) here: the Capacity Block was paid upfront" in out
    assert "(Capacity Block) in us-east-1" in out
    # one that begins within 30 minutes: accepted, and the plan says the launch waits for it
    fake.rows[BLOCK] = reservation(BLOCK, block=True, itype="p5.48xlarge", total=2, state="scheduled",
                                   start=now + HOUR / 4, end=now + 48 * HOUR)
    plan = _estimator(account, rec, "ml.p5.48xlarge", capacity_reservation_id=BLOCK).fit(dry_run=True, job_name="cb2")
    assert plan.capacity.state == "scheduled" and plan.warnings == ()
    assert "(scheduled: begins in 0.2 h, and the launch waits for it)" in capsys.readouterr().out
    # one that begins in 5 hours: fit() would block that long, so it is refused with when to call it
    fake.rows[BLOCK] = reservation(BLOCK, block=True, itype="p5.48xlarge", total=2, state="scheduled",
                                   start=now + 5 * HOUR, end=now + 53 * HOUR)
    with pytest.raises(ConfigError, match=r"begins at .* UTC, in 5\.0 h: call fit\(\) at most 30 minutes before"):
        _estimator(account, rec, "ml.p5.48xlarge", capacity_reservation_id=BLOCK).fit(dry_run=True, job_name="cb3")
    assert rec.created() == []


def test_a_block_ending_before_max_run_is_a_warning_not_an_error(account, capsys):
    rec = Recorder()
    now = datetime.now(timezone.utc).replace(microsecond=0)
    fake = Reservations(rec.session, reservation(BLOCK, block=True, itype="p5.48xlarge", total=2, start=now - HOUR,
                                                 end=now + 10 * HOUR))
    plan = _estimator(account, rec, "ml.p5.48xlarge", capacity_reservation_id=BLOCK, max_run=12 * 3600).fit(
        dry_run=True, job_name="short-block")
    (warning,) = plan.warnings
    assert f"ends at {_utc(now + 10 * HOUR)} UTC" in warning and "30 minutes" in warning
    assert "stopped after about 9.5 h, before max_run (12 h)" in warning
    assert "  WARNING:   Capacity Block" in capsys.readouterr().out
    # an ODCR that ends early only loses the reservation: its instances run on as On-Demand (a note)
    fake.rows[ODCR] = reservation(ODCR, end=now + 10 * HOUR)
    plan = _estimator(account, rec, capacity_reservation_id=ODCR, max_run=12 * 3600).fit(dry_run=True, job_name="short")
    assert plan.warnings == () and any("keep running past it as ordinary On-Demand" in n for n in plan.notes)
    assert rec.created() == []


def _now() -> datetime:
    return datetime.now(timezone.utc)


REFUSED = {
    "wrong type": (dict(itype="p5.48xlarge"), "reserves p5.48xlarge, and the job asks for p4d.24xlarge"),
    "too few": (dict(total=4, available=1),
                r"has 1 of its 4 x p4d.24xlarge available \(3 in use\), and the job needs 2"),
    "expired": (dict(state="expired"), f"On-Demand Capacity Reservation {ODCR} is expired: it has ended"),
    "cancelled": (dict(state="cancelled"), "is cancelled: it was cancelled"),
    "odcr not begun": (dict(state="scheduled", start=_now() + 5 * HOUR),
                       r"is scheduled \(from .* UTC\): it has not begun"),
    "block ending now": (dict(block=True, start=_now() - 47 * HOUR, end=_now() + 0.25 * HOUR),
                         "EC2 terminates its instances from .* on: no job can run in it now"),
    "block unpaid": (dict(block=True, state="payment-failed"), "is payment-failed: its payment failed"),
    "windows": (dict(InstancePlatform="Windows"), "is for Windows instances"),
    "dedicated": (dict(Tenancy="dedicated"), "has dedicated tenancy"),
    "placement group": (dict(PlacementGroupArn="arn:aws:ec2:us-east-1:123456789012:placement-group/theirs"),
                        "reserved in the placement group .*theirs"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_reservation_that_cannot_run_the_job_is_refused_before_anything_is_created(account, case):
    over, message = REFUSED[case]
    rec = Recorder()
    block = over.get("block", False)
    Reservations(rec.session, reservation(BLOCK if block else ODCR, **over))
    est = _estimator(account, rec, capacity_reservation_id=BLOCK if block else ODCR)
    with pytest.raises(ConfigError, match=message) as caught:
        est.fit(wait=False, job_name=f"refused-{case.replace(' ', '-')}")
    assert caught.value.field == "capacity_reservation_id"
    assert rec.created() == [] and rec.params("DescribeCapacityReservations")
    assert not boto3.client("s3").list_objects_v2(Bucket="ty-out").get("KeyCount")  # not even the code


def test_an_unknown_reservation_is_named_with_the_region(account):
    rec = Recorder()
    Reservations(rec.session, reservation(ODCR))
    with pytest.raises(ConfigError, match="capacity reservation cr-0000000000000000a not found in us-east-1"):
        _estimator(account, rec, capacity_reservation_id="cr-0000000000000000a").fit(wait=False, job_name="unknown")
    assert rec.created() == []


def test_spot_with_a_reservation_and_a_malformed_id_are_refused_when_the_estimator_is_built(account):
    rec = Recorder()
    with pytest.raises(ConfigError, match="spot instances never launch into it") as caught:
        _estimator(account, rec, capacity_reservation_id=ODCR, use_spot_instances=True, max_wait=90000)
    assert caught.value.field == "capacity_reservation_id"
    with pytest.raises(ConfigError, match="'cr-' and 8 or 17 hex digits") as caught:
        _estimator(account, rec, capacity_reservation_id="cr-12")
    assert caught.value.field == "capacity_reservation_id" and rec.calls == []


def test_local_jobs_name_it_inert_and_terraform_refuses_it(account, tmp_path, capsys):
    from trainyard import Estimator

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", capacity_reservation_id=ODCR)
    assert est.inert_arguments == ("capacity_reservation_id",) and est.capacity_reservation_id is None
    assert "accepted with no effect on local jobs: capacity_reservation_id" in capsys.readouterr().err
    with pytest.raises(ConfigError) as caught:
        _estimator(account, Recorder(), capacity_reservation_id=ODCR).to_terraform(str(tmp_path / "tf"),
                                                                                  region="us-east-1")
    assert caught.value.field == "capacity_reservation_id"


def test_subnets_must_be_in_the_reservations_zone(account):
    rec = Recorder()
    row = reservation(ODCR)
    Reservations(rec.session, row)
    subnet = {s["AvailabilityZone"]: s["SubnetId"] for s in boto3.client("ec2").describe_subnets()["Subnets"]
              if s.get("DefaultForAz")}
    there, elsewhere = row["AvailabilityZone"], zones("p4d.24xlarge")[0][0]
    with pytest.raises(ConfigError) as caught:
        _estimator(account, rec, capacity_reservation_id=ODCR, subnets=[subnet[elsewhere], subnet[there]]).fit(
            wait=False, job_name="other-zone")
    assert caught.value.field == "subnets" and subnet[elsewhere] in str(caught.value)
    assert elsewhere in str(caught.value) and there in str(caught.value) and subnet[there] not in str(caught.value)
    assert rec.created() == []
    # a subnet in its zone is used; it is given a default route to a NAT gateway (a private subnet, as a job's
    # subnets must be: preflight's check of the user's network passes)
    ec2 = boto3.client("ec2")
    eip = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=subnet[elsewhere], AllocationId=eip)["NatGateway"]["NatGatewayId"]
    table = ec2.create_route_table(VpcId=ec2.describe_subnets(SubnetIds=[subnet[there]])["Subnets"][0]["VpcId"])
    table = table["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet[there])
    plan = _estimator(account, rec, capacity_reservation_id=ODCR, subnets=[subnet[there]]).fit(
        dry_run=True, job_name="same-zone")
    assert plan.subnets_to_try == (subnet[there],) and plan.zone == there


def _launch_template_data(rec: Recorder) -> dict:
    (template,) = rec.params("CreateLaunchTemplate")
    prefix = "LaunchTemplateData."
    return {k.removeprefix(prefix): v for k, v in template.items() if k.startswith(prefix)}


@pytest.mark.parametrize("block", [False, True], ids=["odcr", "capacity-block"])
def test_the_launch_targets_the_reservation_in_its_zone_only(account, block):
    rec = Recorder()
    rid, itype = (BLOCK, "p5.48xlarge") if block else (ODCR, "p4d.24xlarge")
    row = reservation(rid, block=block, itype=itype)
    Reservations(rec.session, row)
    name = f"launch-{'cb' if block else 'odcr'}"
    job = _estimator(account, rec, f"ml.{itype}", capacity_reservation_id=rid).fit(wait=False, job_name=name)
    try:
        data = _launch_template_data(rec)
        assert data["CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"] == rid
        assert "CapacityReservationSpecification.CapacityReservationPreference" not in data  # one option only
        assert data.get("InstanceMarketOptions.MarketType") == ("capacity-block" if block else None)
        assert not any(k.startswith("InstanceMarketOptions.SpotOptions") for k in data)
        # the job's subnet (and the VPC's shared endpoints' own) in the reservation's zone only: no fallback
        assert {s["AvailabilityZone"] for s in rec.params("CreateSubnet")} == {row["AvailabilityZone"]}
        (run,) = rec.params("RunInstances")
        assert run["MinCount"] == run["MaxCount"] == "2"
    finally:
        job.stop()
    assert leftovers(name) == {}


def test_a_capacity_error_in_the_reservation_tries_no_other_zone(account):
    from trainyard.errors import JobFailedError

    rec = Recorder()
    rec.fail["RunInstances"] = "InsufficientInstanceCapacity"
    Reservations(rec.session, reservation(ODCR))
    with pytest.raises(JobFailedError, match=f"On-Demand Capacity Reservation {ODCR} had no room"):
        _estimator(account, rec, capacity_reservation_id=ODCR).fit(wait=False, job_name="full")
    assert len(rec.params("RunInstances")) == 1  # one zone tried, the reservation's
    assert {s["AvailabilityZone"] for s in rec.params("CreateSubnet")} == {reservation(ODCR)["AvailabilityZone"]}
    assert leftovers("full") == {}


def test_a_scheduled_block_is_launched_into_once_it_is_active(account, monkeypatch):
    """The launch waits for the block's start, then asks until EC2 reports it active."""
    from trainyard.sdk.backends.ec2 import provision

    monkeypatch.setattr(provision, "CAPACITY_POLL_S", 0.1)
    rec = Recorder()
    start = datetime.now(timezone.utc) + timedelta(seconds=2)
    row = reservation(BLOCK, block=True, itype="p5.48xlarge", state="scheduled", start=start, end=start + 48 * HOUR)
    fake = Reservations(rec.session, row)
    answers = iter(["scheduled", "active"])

    def state_after_start(params, **kw):  # preflight sees it scheduled; after its start, scheduled then active
        if fake.asked and datetime.now(timezone.utc) >= start:  # (on a loaded machine preflight may come after it)
            fake.rows[BLOCK] = {**row, "State": next(answers, "active")}
        return fake(params, **kw)

    rec.session.events.unregister("before-call.ec2.DescribeCapacityReservations", fake)
    rec.session.events.register("before-call.ec2.DescribeCapacityReservations", state_after_start)
    job = _estimator(account, rec, "ml.p5.48xlarge", capacity_reservation_id=BLOCK).fit(wait=False, job_name="later")
    try:
        assert len(fake.asked) == 3  # preflight, then scheduled and active after the start
        (run,) = rec.params("RunInstances")
        run_at = [i for i, (name, _) in enumerate(rec.calls) if name == "RunInstances"][0]
        last_asked = max(i for i, (name, _) in enumerate(rec.calls) if name == "DescribeCapacityReservations")
        assert last_asked < run_at and datetime.now(timezone.utc) >= start
    finally:
        job.stop()
    assert leftovers("later") == {}
