"""A plain pyarrow.flight server that keeps tables in host memory: the baseline the benchmark
compares gpu-flight with. Prints `serving on grpc://HOST:PORT` once ready.

    python3 examples/pyarrow_server.py [--port 0]
"""

import argparse
import sys

import pyarrow as pa
import pyarrow.flight as flight


class HostMemoryServer(flight.FlightServerBase):
    def __init__(self, location):
        super().__init__(location)
        self.tables = {}

    def do_put(self, context, descriptor, reader, writer):
        self.tables[descriptor.path[0]] = reader.read_all()

    def get_flight_info(self, context, descriptor):
        table = self.tables[descriptor.path[0]]
        endpoint = flight.FlightEndpoint(descriptor.path[0], [])
        return flight.FlightInfo(table.schema, descriptor, [endpoint], table.num_rows, table.nbytes)

    def do_get(self, context, ticket):
        return flight.RecordBatchStream(self.tables[ticket.ticket])

    def do_action(self, context, action):
        if action.type == "drop":
            self.tables.pop(action.body.to_pybytes(), None)
        return []


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = HostMemoryServer(f"grpc://127.0.0.1:{args.port}")
    print(f"serving on grpc://127.0.0.1:{server.port}", flush=True)
    server.serve()


if __name__ == "__main__":
    sys.exit(main())
