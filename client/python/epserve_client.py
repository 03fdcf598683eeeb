"""A small Python client of the epserve front-end (KServe v2 over gRPC).

Needs grpcio, numpy and the protocol's Python modules (grpc_service_pb2, model_config_pb2,
health_pb2), which the build generates into <build>/proto/python; put that folder on
sys.path or PYTHONPATH. On Debian: apt-get install python3-grpcio python3-numpy
python3-protobuf, and run it with /usr/bin/python3.

    import epserve_client
    y = epserve_client.moe_layer(x)      # one call: x [T, H] numpy -> y [T, H] numpy

    from epserve_client import Client
    c = Client("127.0.0.1:8001")
    y = c.infer(x)                       # x: float32 [T, H]; y: float32 [T, H]
    y = c.infer(x, datatype="BF16")      # sent as BF16, answered in BF16, returned as float32

A Client is thread-safe (one gRPC channel; calls may run concurrently).

On the server's host, rows can travel through system shared memory instead of the gRPC
message (Triton's extension): the input is written into a POSIX shared-memory region that
the server reads, and the answer is written by the server into the same region.

    with c.shared_memory_rows(max_tokens=4096, hidden=H, datatype="BF16") as rows:
        y = c.infer(x, datatype="BF16", shared_memory=rows)   # no rows in the messages
"""

import itertools
import os
import queue
import threading
from multiprocessing import shared_memory as _shm

import grpc
import numpy as np

import grpc_service_pb2 as pb
import health_pb2

_SERVICE = "/inference.GRPCInferenceService/"
INPUT = "hidden_states"
OUTPUT = "moe_output"
TOPK_IDS = "topk_ids"
TOPK_WEIGHTS = "topk_weights"


class InferError(Exception):
    """A failed inference; `code` is the grpc.StatusCode (None for an in-band stream error)."""

    def __init__(self, code, message, request_id=""):
        super().__init__(f"{code}: {message}" if code else message)
        self.code = code
        self.message = message
        self.request_id = request_id


def encode(x, datatype):
    """Array -> little-endian bytes of `datatype`: float values become FP32, BF16 (rounded to
    nearest even) or FP16; an array already in the datatype's own form (float16 for FP16,
    uint16 holding BF16 bits for BF16, e.g. a torch bfloat16 tensor's .view(torch.int16)) is
    sent as it is."""
    x = np.asarray(x)
    if datatype == "BF16" and x.dtype in (np.uint16, np.int16):
        return np.ascontiguousarray(x).view("<u2").tobytes()
    if datatype == "FP16" and x.dtype == np.float16:
        return np.ascontiguousarray(x, dtype="<f2").tobytes()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if datatype == "FP32":
        return x.astype("<f4", copy=False).tobytes()
    if datatype == "FP16":
        return x.astype("<f2").tobytes()
    if datatype == "BF16":
        # Round to nearest even in 32-bit words: only NaNs (set right below) can wrap.
        bits = x.view(np.uint32)
        rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16)
        rounded = rounded.astype("<u2")
        nan = np.isnan(x)
        if nan.any():
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")
        return rounded.tobytes()
    raise ValueError(f"unsupported datatype {datatype!r}")


def decode(raw, datatype, shape, as_stored=False):
    """Bytes of `datatype` -> float32 array of `shape`; with `as_stored`, the datatype's own
    form instead (float16 for FP16, uint16 BF16 bits for BF16), with no conversion."""
    if datatype == "FP32":
        out = np.frombuffer(raw, dtype="<f4")
    elif datatype == "FP16":
        out = np.frombuffer(raw, dtype="<f2")
        out = out if as_stored else out.astype(np.float32)
    elif datatype == "BF16":
        out = np.frombuffer(raw, dtype="<u2")
        out = out if as_stored else (out.astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"unsupported datatype {datatype!r}")
    return out.reshape(shape)


_BYTES_PER_VALUE = {"FP32": 4, "BF16": 2, "FP16": 2}
_region_ids = itertools.count()


class SharedMemoryRows:
    """A POSIX shared-memory object registered with the server under `name`, with room for
    one request's input rows and its answer (up to `max_tokens` rows of `hidden` values of
    the widest of `datatype` and `output_datatype`). Made by Client.shared_memory_rows; one
    request at a time uses it. close() (or leaving the `with` block) unregisters and unlinks
    it."""

    def __init__(self, client, max_tokens, hidden, datatype="FP32", output_datatype=None):
        if max_tokens < 1 or hidden < 1:
            raise ValueError(f"max_tokens and hidden must be >= 1, got {max_tokens}, {hidden}")
        width = max(_BYTES_PER_VALUE[datatype], _BYTES_PER_VALUE[output_datatype or datatype])
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.half = max_tokens * hidden * width  # input at 0, output at `half`
        self.shm = _shm.SharedMemory(create=True, size=2 * self.half)
        self.name = f"epserve-py-{os.getpid()}-{next(_region_ids)}"
        self._client = client
        try:
            client.register_system_shared_memory(self.name, "/" + self.shm.name, 2 * self.half)
        except BaseException:
            self.shm.close()
            self.shm.unlink()
            raise

    def close(self):
        if self.shm is None:
            return
        try:
            self._client.unregister_system_shared_memory(self.name)
        finally:
            self.shm.close()
            self.shm.unlink()
            self.shm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def write_input(self, payload):
        self.shm.buf[:len(payload)] = payload

    def read_output(self, nbytes):
        return bytes(self.shm.buf[self.half:self.half + nbytes])


class Client:
    def __init__(self, address, model="moe", *, root_certificates=None, private_key=None,
                 certificate_chain=None, token=None, max_message_bytes=512 << 20,
                 ssl_target_name=None):
        """`address` is host:port. TLS when `root_certificates` (PEM bytes) is given; mutual
        TLS with `private_key` and `certificate_chain` as well. `token`: bearer token."""
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if ssl_target_name:
            options.append(("grpc.ssl_target_name_override", ssl_target_name))
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                 certificate_chain)
            self.channel = grpc.secure_channel(address, creds, options)
        else:
            self.channel = grpc.insecure_channel(address, options)
        self.model = model
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def close(self):
        self.channel.close()

    def _unary(self, method, request, response_type, timeout=30.0):
        call = self.channel.unary_unary(_SERVICE + method,
                                        request_serializer=type(request).SerializeToString,
                                        response_deserializer=response_type.FromString)
        return call(request, timeout=timeout, metadata=self.metadata)

    # ---- health and metadata
    def live(self):
        return self._unary("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse).live

    def ready(self):
        return self._unary("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse).ready

    def model_ready(self):
        return self._unary("ModelReady", pb.ModelReadyRequest(name=self.model),
                           pb.ModelReadyResponse).ready

    def server_metadata(self):
        return self._unary("ServerMetadata", pb.ServerMetadataRequest(),
                           pb.ServerMetadataResponse)

    def model_metadata(self):
        return self._unary("ModelMetadata", pb.ModelMetadataRequest(name=self.model),
                           pb.ModelMetadataResponse)

    def model_config(self):
        return self._unary("ModelConfig", pb.ModelConfigRequest(name=self.model),
                           pb.ModelConfigResponse).config

    def model_statistics(self):
        return self._unary("ModelStatistics", pb.ModelStatisticsRequest(name=self.model),
                           pb.ModelStatisticsResponse).model_stats[0]

    def health(self, service=""):
        """grpc.health.v1 Check: 'SERVING', 'NOT_SERVING', ... (no token needed)."""
        call = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        resp = call(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # ---- system shared memory and the model repository
    def register_system_shared_memory(self, name, key, byte_size, offset=0):
        self._unary("SystemSharedMemoryRegister",
                    pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset,
                                                         byte_size=byte_size),
                    pb.SystemSharedMemoryRegisterResponse)

    def unregister_system_shared_memory(self, name=""):
        """Unregisters `name`, or every region when name is ''."""
        self._unary("SystemSharedMemoryUnregister",
                    pb.SystemSharedMemoryUnregisterRequest(name=name),
                    pb.SystemSharedMemoryUnregisterResponse)

    def system_shared_memory_status(self, name=""):
        """{region name: RegionStatus} of the registered regions (or only `name`)."""
        return dict(self._unary("SystemSharedMemoryStatus",
                                pb.SystemSharedMemoryStatusRequest(name=name),
                                pb.SystemSharedMemoryStatusResponse).regions)

    def shared_memory_rows(self, max_tokens, hidden, datatype="FP32", output_datatype=None):
        """A registered SharedMemoryRows region for infer(..., shared_memory=region)."""
        return SharedMemoryRows(self, max_tokens, hidden, datatype, output_datatype)

    def repository_index(self):
        """[(name, version, state, reason)] of the served model."""
        resp = self._unary("RepositoryIndex", pb.RepositoryIndexRequest(),
                           pb.RepositoryIndexResponse)
        return [(m.name, m.version, m.state, m.reason) for m in resp.models]

    def unload_model(self):
        """Takes the model out of service (ModelReady false, new requests NOT_FOUND)."""
        self._unary("RepositoryModelUnload",
                    pb.RepositoryModelUnloadRequest(model_name=self.model),
                    pb.RepositoryModelUnloadResponse)

    def load_model(self, model=None, seed=None, timeout=600.0):
        """Puts an unloaded model back into service; with `model` (a checkpoint folder on the
        server's host, or synthetic:<preset>) and optionally `seed`, replaces the served
        weights with those, between requests (same shape only). Returns when done."""
        req = pb.RepositoryModelLoadRequest(model_name=self.model)
        if model is not None:
            req.parameters["model"].string_param = model
        if seed is not None:
            req.parameters["seed"].int64_param = seed
        self._unary("RepositoryModelLoad", req, pb.RepositoryModelLoadResponse, timeout=timeout)

    # ---- inference
    def request(self, x, *, datatype="FP32", output_datatype=None, layer=None, priority=None,
                timeout_us=None, request_id="", shared_memory=None, routing=False):
        """The ModelInferRequest for rows `x` [T, H] (float values, or already in `datatype`'s
        own form: see encode()) sent as `datatype`. With
        `shared_memory` (a SharedMemoryRows) the rows are written into the region and the
        request names it for the input and for moe_output instead of carrying bytes. With
        `routing` the answer also carries each row's top-k expert ids and weights (routing())."""
        x = np.asarray(x)
        req = pb.ModelInferRequest(model_name=self.model, id=request_id)
        inp = req.inputs.add(name=INPUT, datatype=datatype, shape=list(x.shape))
        payload = encode(x, datatype)
        out = None  # the requested moe_output, where the request names one
        if shared_memory is None:
            req.raw_input_contents.append(payload)
        else:
            region = shared_memory
            if x.ndim != 2 or x.shape[0] > region.max_tokens or x.shape[1] != region.hidden:
                raise ValueError(f"x {x.shape} does not fit the region's "
                                 f"[{region.max_tokens}, {region.hidden}]")
            region.write_input(payload)
            inp.parameters["shared_memory_region"].string_param = region.name
            inp.parameters["shared_memory_byte_size"].int64_param = len(payload)
            out_bytes = x.size * _BYTES_PER_VALUE[output_datatype or datatype]
            out = req.outputs.add(name=OUTPUT)
            out.parameters["shared_memory_region"].string_param = region.name
            out.parameters["shared_memory_byte_size"].int64_param = out_bytes
            out.parameters["shared_memory_offset"].int64_param = region.half
        if output_datatype is not None or (routing and out is None):
            out = out or req.outputs.add(name=OUTPUT)
            if output_datatype is not None:
                out.parameters["datatype"].string_param = output_datatype
        if routing:
            req.outputs.add(name=TOPK_IDS)
            req.outputs.add(name=TOPK_WEIGHTS)
        if layer is not None:
            req.parameters["layer"].int64_param = layer
        if priority is not None:
            req.parameters["priority"].int64_param = priority
        if timeout_us is not None:
            req.parameters["timeout"].int64_param = timeout_us
        return req

    @staticmethod
    def routing(resp):
        """(ids int32 [T, k], weights float32 [T, k]) of a response to a request made with
        routing=True: the experts the server's router chose for each row and their weights."""
        # raw_output_contents line up with outputs (empty where an output went to a region).
        found = {t.name: (t, raw) for t, raw in zip(resp.outputs, resp.raw_output_contents)}
        (ids_t, ids_raw), (w_t, w_raw) = found[TOPK_IDS], found[TOPK_WEIGHTS]
        ids = np.frombuffer(ids_raw, dtype="<i4").reshape(tuple(ids_t.shape))
        return ids, decode(w_raw, w_t.datatype, tuple(w_t.shape))

    @staticmethod
    def output(resp, shared_memory=None, as_stored=False):
        """The float32 array of a ModelInferResponse's moe_output (read from the region when
        the request named one); with `as_stored`, in its datatype's own form (decode())."""
        t = resp.outputs[0]
        shape = tuple(t.shape)
        if shared_memory is not None:
            nbytes = int(np.prod(shape)) * _BYTES_PER_VALUE[t.datatype]
            return decode(shared_memory.read_output(nbytes), t.datatype, shape, as_stored)
        return decode(resp.raw_output_contents[0], t.datatype, shape, as_stored)

    def infer(self, x, *, timeout=60.0, as_stored=False, **kwargs):
        """Rows `x` through the served MoE layer; returns float32 [T, H] (with `as_stored`, the
        answer's datatype's own form: decode()). Raises InferError. kwargs as request(); with
        shared_memory=region the rows go through the region."""
        try:
            resp = self._unary("ModelInfer", self.request(x, **kwargs), pb.ModelInferResponse,
                               timeout=timeout)
        except grpc.RpcError as e:
            raise InferError(e.code(), e.details(), kwargs.get("request_id", "")) from None
        return self.output(resp, kwargs.get("shared_memory"), as_stored)

    def infer_routing(self, x, *, timeout=60.0, **kwargs):
        """As infer(), and the routing the server chose: (output [T, H], topk ids int32 [T, k],
        topk weights float32 [T, k])."""
        try:
            resp = self._unary("ModelInfer", self.request(x, routing=True, **kwargs),
                               pb.ModelInferResponse, timeout=timeout)
        except grpc.RpcError as e:
            raise InferError(e.code(), e.details(), kwargs.get("request_id", "")) from None
        return (self.output(resp, kwargs.get("shared_memory")), *self.routing(resp))

    def open_stream(self, timeout=60.0):
        """An InferStream: one ModelStreamInfer stream for requests sent one at a time."""
        return InferStream(self, timeout)

    def stream_infer(self, requests, timeout=120.0):
        """Sends ModelInferRequests (see request()) over one ModelStreamInfer stream; yields
        (id, float32 array or InferError) in the order the answers arrive."""
        call = self.channel.stream_stream(
            _SERVICE + "ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString)
        for resp in call(iter(requests), timeout=timeout, metadata=self.metadata):
            rid = resp.infer_response.id
            if resp.error_message:
                yield rid, InferError(None, resp.error_message, rid)
            else:
                yield rid, self.output(resp.infer_response)


class InferStream:
    """One ModelStreamInfer stream for a sequence of requests sent one after another: infer()
    sends a request and waits for its answer, so that a caller whose next request depends on the
    last answer (a model's forward pass, layer by layer) keeps one stream open instead of making
    a call per request. One caller at a time (not thread-safe). Each answer is waited for at
    most `timeout` seconds; after a failed wait the stream is cancelled and unusable. close()
    (or leaving the `with` block) ends the stream."""

    _END = object()

    def __init__(self, client, timeout=60.0):
        self._client = client
        self._timeout = timeout
        self._requests = queue.SimpleQueue()
        self._answers = queue.SimpleQueue()
        call = client.channel.stream_stream(
            _SERVICE + "ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString)
        self._call = call(iter(self._requests.get, self._END), metadata=client.metadata)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._broken = None

    def _read(self):
        try:
            for resp in self._call:
                self._answers.put(resp)
            self._answers.put(InferError(None, "the server ended the stream"))
        except grpc.RpcError as e:
            self._answers.put(InferError(e.code(), e.details()))

    def infer(self, x, as_stored=False, **kwargs):
        """As Client.infer, over the stream (kwargs as Client.request)."""
        if self._broken is not None:
            raise self._broken
        self._requests.put(self._client.request(x, **kwargs))
        try:
            resp = self._answers.get(timeout=self._timeout)
        except queue.Empty:
            self._broken = InferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no answer within {self._timeout} s on the stream")
            self._call.cancel()
            raise self._broken from None
        if isinstance(resp, InferError):
            self._broken = resp
            raise resp
        if resp.error_message:
            raise InferError(None, resp.error_message, resp.infer_response.id)
        return self._client.output(resp.infer_response, kwargs.get("shared_memory"), as_stored)

    def close(self):
        self._requests.put(self._END)
        self._reader.join(timeout=self._timeout)
        if self._reader.is_alive():
            self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_DATATYPE_OF = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16"}


def moe_layer(x, address="127.0.0.1:8001", model="moe", *, layer=None, datatype=None,
              token=None, root_certificates=None, timeout=60.0):
    """The served MoE layer applied to the rows of `x` (a numpy array [T, H], or [H] for one
    token); returns a numpy array of the same shape.

    float16 input travels as FP16 and comes back float16; any other float input travels as
    FP32 (or as `datatype`: "FP32", "BF16", "FP16") and comes back float32. `layer` is the
    model's own layer index (None: the first served layer). `token`: bearer token;
    `root_certificates`: PEM bytes of the server's CA, for TLS. Raises InferError (with the
    gRPC code) when the server refuses the request. Opens and closes a channel per call: for
    many calls, keep a Client."""
    x = np.asarray(x)
    if x.ndim not in (1, 2):
        raise ValueError(f"x must be [T, H] or [H], got shape {x.shape}")
    if datatype is None:
        datatype = _DATATYPE_OF.get(x.dtype, "FP32")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    client = Client(address, model, token=token, root_certificates=root_certificates)
    try:
        y = client.infer(rows.astype(np.float32), datatype=datatype, layer=layer,
                         timeout=timeout)
    finally:
        client.close()
    if x.dtype == np.float16 and datatype == "FP16":
        y = y.astype(np.float16)
    return y.reshape(x.shape)
