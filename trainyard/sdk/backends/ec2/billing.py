"""How long an EC2 job's instances ran and what that costs: `describe()`'s `BillableTimeInSeconds` and
`EstimatedCost`.

The job's status document (`jobstate.Status`) keeps one record per instance the job launched, every
attempt's, under `InstanceTimes`:

    {"InstanceId": "i-0...", "Attempt": 1, "LaunchTime": "2026-11-24T08:01:02+00:00", "EndTime": "..."}

`LaunchTime` is EC2's own (RunInstances' reply: when the instance was asked for), recorded by whoever
launched it (`fit()` for the first attempt, the controller for a spot job's next one). `EndTime` is when
the controller asked EC2 to terminate it, or first saw it shutting down, stopping or gone (an instance that
ended itself); absent while it runs. Instance-hours are the sum of those spans (now, or the job's end, for
one still open). EC2 bills from `running` to `shutting-down`, per second with a minimum of 60 s: the spans
here also hold the seconds an instance was pending, and the minimum is not applied.

The price is the shipped table's (`catalog.hourly_price`): the On-Demand list price of the job's region, or
for spot an estimate from it. Nothing here calls AWS.
"""
from __future__ import annotations

from datetime import datetime

from trainyard.job import catalog
from trainyard.job.jsonio import now_iso
from trainyard.sdk.jobs.jobstate import Status

KEY = "InstanceTimes"


def launched(status: Status, instances: list[dict], attempt: int) -> None:
    """Record RunInstances' `instances` (their `LaunchTime`, a datetime; now if the reply has none)."""
    records = status.doc.setdefault(KEY, [])
    for inst in instances or []:
        t = inst.get("LaunchTime")
        records.append({"InstanceId": inst["InstanceId"], "Attempt": attempt,
                        "LaunchTime": t.isoformat() if isinstance(t, datetime) else now_iso()})
    status.update()


def ended(status: Status, instance_ids, at: str | None = None) -> None:
    """Record that the instances `instance_ids` ended (are being terminated) now, or `at`; those already
    recorded as ended keep their time."""
    ids, t = set(instance_ids), at or now_iso()
    changed = False
    for record in status.doc.get(KEY, []):
        if record["InstanceId"] in ids and "EndTime" not in record:
            record["EndTime"] = max(t, record["LaunchTime"], key=datetime.fromisoformat)
            changed = True
    if changed:
        status.update()


def running(status: Status) -> list[str]:
    """The instances recorded as launched and not ended."""
    return [r["InstanceId"] for r in status.doc.get(KEY, []) if "EndTime" not in r]


def instance_seconds(records: list[dict], until: datetime) -> float:
    """Seconds the instances of `records` ran, summed; one still running counts up to `until`."""
    total = 0.0
    for r in records:
        end = datetime.fromisoformat(r["EndTime"]) if "EndTime" in r else until
        total += max(0.0, (end - datetime.fromisoformat(r["LaunchTime"])).total_seconds())
    return total


def usage(spec, region: str, records: list[dict], until: datetime) -> dict:
    """`BillableTimeInSeconds` and (when the table has a price) `EstimatedCost` of an EC2 job.

    BillableTimeInSeconds follows SageMaker's DescribeTrainingJob: wall-clock seconds of ONE instance, so
    that BillableTimeInSeconds x InstanceCount is the compute billed; here the instance-seconds of every
    attempt divided by the instance count. EstimatedCost: Amount = InstanceHours x PricePerHour, where
    InstanceHours adds up every instance's hours (instance count x hours each ran, over every attempt)."""
    seconds = instance_seconds(records, until)
    out: dict = {"BillableTimeInSeconds": round(seconds / spec.instance_count)}
    price = catalog.hourly_price(spec.instance_type, region, spot=spec.use_spot_instances)
    if price is not None:
        hours = seconds / 3600
        out["EstimatedCost"] = {"Amount": hours * price.per_hour, "Currency": catalog.price_table()["currency"],
                                "InstanceHours": hours, "PricePerHour": price.per_hour, "Market": price.market,
                                "Source": price.source}
    return out
