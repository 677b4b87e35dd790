"""A local S3-compatible server (moto's server mode) on loopback, and the environment that points s3fs at it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

S3_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def s3_server(bucket: str) -> Iterator[dict[str, str]]:
    """Starts moto on 127.0.0.1 (a free port), creates `bucket`; yields the environment s3fs needs.

    The variables are set in this process for the duration (child processes inherit them).
    """
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    environment = {**S3_ENVIRONMENT, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        boto3.client("s3", endpoint_url=environment["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
        yield environment
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
