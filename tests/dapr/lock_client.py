"""Drive a Dapr lock store with Dapr's own Python SDK, unmodified, as an app written for Dapr
would: DaprClient() finds the sidecar through DAPR_HTTP_PORT and DAPR_GRPC_PORT, waits for its
health endpoint, then calls TryLockAlpha1 and UnlockAlpha1 over gRPC. Prints what it saw as one
JSON object for tests/tests/dapr.rs to check."""

import json
import sys
import warnings

from dapr.clients import DaprClient

warnings.simplefilter("ignore")  # "The Distributed Lock API is an Alpha version"

store, key = sys.argv[1], sys.argv[2]
seen = {}
with DaprClient() as dapr:
    seen["first"] = dapr.try_lock(store, key, "worker-1", 10).success
    seen["other_owner"] = dapr.try_lock(store, key, "worker-2", 10).success
    seen["same_owner_again"] = dapr.try_lock(store, key, "worker-1", 10).success
    seen["unlock_by_other"] = dapr.unlock(store, key, "worker-2").status.value
    seen["unlock"] = dapr.unlock(store, key, "worker-1").status.value
    seen["unlock_again"] = dapr.unlock(store, key, "worker-1").status.value
    seen["after_release"] = bool(dapr.try_lock(store, key, "worker-2", 10))
    with dapr.try_lock(store, key + "-scoped", "worker-3", 10) as lock:
        seen["scoped"] = bool(lock)
    seen["after_scope"] = dapr.try_lock(store, key + "-scoped", "worker-4", 10).success
    try:
        dapr.try_lock(store, key + "-long", "worker-1", 3600)
        seen["beyond_lease"] = "accepted"
    except Exception as e:  # grpc.RpcError
        seen["beyond_lease"] = str(getattr(e, "code", lambda: e)())
    try:
        dapr.try_lock("no-such-store", key, "worker-1", 10)
        seen["unknown_store"] = "accepted"
    except Exception as e:  # grpc.RpcError
        seen["unknown_store"] = str(getattr(e, "code", lambda: e)())
print(json.dumps(seen))
