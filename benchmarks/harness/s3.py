"""A moto S3 server on loopback for the benchmarks that read from ``s3://`` (in the
benchmark's driver process, on a port the OS chose), with one bucket made.
"""

from __future__ import annotations

from typing import Any

from elastic.testing.ports import free_port

KEY, SECRET, REGION = "testing", "testing", "us-east-1"


class MotoS3:
    def __init__(self, bucket: str):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.client = self.client_for(self.endpoint)
        self.client.create_bucket(Bucket=bucket)

    @staticmethod
    def client_for(endpoint: str) -> Any:
        import boto3

        return boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
        )

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """s3fs arguments for this server (or a proxy in front of it): the native reader hands
        them to fsspec as they are."""
        client = {"endpoint_url": endpoint or self.endpoint, "region_name": REGION}
        return {"key": KEY, "secret": SECRET, "client_kwargs": client}

    @staticmethod
    def environ(endpoint: str) -> dict[str, str]:
        """The AWS variables that point every S3 client of the job (workers too) at ``endpoint``."""
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
        }

    def stop(self) -> None:
        self.server.stop()
