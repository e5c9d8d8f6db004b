// A JVM client of gpu-flight for the test suite (tests/python/test_java_client.py): plain gRPC
// stubs generated from Arrow's Flight.proto (proto/), and Arrow Java's IPC reader and writer from
// the jars pyspark ships. It shows that JVM Arrow readers (Spark's among them) take the server's
// FlightData as they come: each data_header is an Arrow IPC flatbuffer Message and data_body its
// body, handed to Arrow Java's MessageSerializer unchanged, as Arrow's Flight Java client does.
//
//   FlightJavaClient get URI NAME OUT.arrow   GetFlightInfo(PATH NAME), then DoGet of every
//                                             endpoint in order; the rows go to OUT.arrow (an
//                                             Arrow IPC file)
//   FlightJavaClient put URI NAME IN.arrow    DoPut(PATH NAME) of IN.arrow's batches
//
// URI is grpc://host:port (or grpc+tcp://). GPU_FLIGHT_TOKEN in the environment, if set, is sent as
// a bearer token. A gRPC error is printed to stderr as "grpc error: CODE: message" (exit status 2).
// Dictionary-encoded columns are refused: the IPC file this writes would need one dictionary for
// every endpoint's batches.

import com.google.protobuf.ByteString;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.StreamObserver;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.net.URI;
import java.nio.ByteBuffer;
import java.nio.channels.Channels;
import java.nio.channels.FileChannel;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.apache.arrow.flatbuf.Message;
import org.apache.arrow.flatbuf.MessageHeader;
import org.apache.arrow.flight.impl.Flight;
import org.apache.arrow.flight.impl.FlightServiceGrpc;
import org.apache.arrow.memory.ArrowBuf;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.memory.RootAllocator;
import org.apache.arrow.vector.VectorLoader;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.VectorUnloader;
import org.apache.arrow.vector.ipc.ArrowFileReader;
import org.apache.arrow.vector.ipc.ArrowFileWriter;
import org.apache.arrow.vector.ipc.WriteChannel;
import org.apache.arrow.vector.ipc.message.ArrowRecordBatch;
import org.apache.arrow.vector.ipc.message.IpcOption;
import org.apache.arrow.vector.ipc.message.MessageSerializer;
import org.apache.arrow.vector.types.pojo.Field;
import org.apache.arrow.vector.types.pojo.Schema;

public final class FlightJavaClient {
  /** The location that means "the connection this FlightInfo came on" (Flight's specification). */
  private static final String REUSE_CONNECTION = "arrow-flight-reuse-connection://?";

  private final URI uri;
  private final Metadata headers = new Metadata();
  private final Map<String, ManagedChannel> channels = new HashMap<>();

  private FlightJavaClient(URI uri, String token) {
    this.uri = uri;
    if (token != null && !token.isEmpty()) {
      headers.put(
          Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
    }
  }

  public static void main(String[] args) throws Exception {
    if (args.length != 4 || !(args[0].equals("get") || args[0].equals("put"))) {
      System.err.println("usage: FlightJavaClient get|put URI NAME FILE.arrow");
      System.exit(64);
    }
    FlightJavaClient client =
        new FlightJavaClient(new URI(args[1]), System.getenv("GPU_FLIGHT_TOKEN"));
    int status = 0;
    try (BufferAllocator allocator = new RootAllocator()) {
      if (args[0].equals("get")) {
        client.get(allocator, args[2], Path.of(args[3]));
      } else {
        client.put(allocator, args[2], Path.of(args[3]));
      }
    } catch (StatusRuntimeException e) {
      Status s = e.getStatus();
      System.err.println("grpc error: " + s.getCode() + ": " + s.getDescription());
      if (s.getCause() != null) {
        s.getCause().printStackTrace(); // a failure on this side (UNKNOWN, INTERNAL)
      }
      status = 2;
    } finally {
      client.close();
    }
    System.exit(status);
  }

  /** A channel to `location` (grpc:// or grpc+tcp://), one per address. */
  private ManagedChannel channel(URI location) {
    String scheme = location.getScheme();
    if (!"grpc".equals(scheme) && !"grpc+tcp".equals(scheme)) {
      throw new IllegalArgumentException("only grpc:// and grpc+tcp:// locations: " + location);
    }
    String target = location.getHost() + ":" + location.getPort();
    return channels.computeIfAbsent(
        target, t -> ManagedChannelBuilder.forTarget(t).usePlaintext().build());
  }

  private FlightServiceGrpc.FlightServiceBlockingStub blocking(URI location) {
    return FlightServiceGrpc.newBlockingStub(channel(location))
        .withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
  }

  private static Flight.FlightDescriptor path(String name) {
    return Flight.FlightDescriptor.newBuilder()
        .setType(Flight.FlightDescriptor.DescriptorType.PATH)
        .addPath(name)
        .build();
  }

  /** Where an endpoint is read: its first grpc location, else the connection that listed it. */
  private URI endpointLocation(Flight.FlightEndpoint endpoint) throws Exception {
    for (Flight.Location location : endpoint.getLocationList()) {
      String text = location.getUri();
      if (text.startsWith("grpc://") || text.startsWith("grpc+tcp://")) {
        return new URI(text);
      }
      if (!text.equals(REUSE_CONNECTION)) {
        System.err.println("skipping location " + text);
      }
    }
    return uri;
  }

  private void get(BufferAllocator allocator, String name, Path out) throws Exception {
    Flight.FlightInfo info = blocking(uri).getFlightInfo(path(name));
    VectorSchemaRoot root = null;
    ArrowFileWriter writer = null;
    FileChannel file =
        FileChannel.open(
            out,
            StandardOpenOption.CREATE,
            StandardOpenOption.WRITE,
            StandardOpenOption.TRUNCATE_EXISTING);
    long rows = 0;
    int batches = 0;
    try {
      for (Flight.FlightEndpoint endpoint : info.getEndpointList()) {
        Iterator<Flight.FlightData> stream =
            blocking(endpointLocation(endpoint)).doGet(endpoint.getTicket());
        boolean schemaSeen = false;
        while (stream.hasNext()) {
          Flight.FlightData data = stream.next();
          if (data.getDataHeader().isEmpty()) {
            continue; // app_metadata alone
          }
          Message message =
              Message.getRootAsMessage(ByteBuffer.wrap(data.getDataHeader().toByteArray()));
          switch (message.headerType()) {
            case MessageHeader.Schema:
              {
                Schema schema = MessageSerializer.deserializeSchema(message);
                if (schemaSeen) {
                  throw new IOException("a second schema message in one stream");
                }
                schemaSeen = true;
                if (root == null) {
                  refuseDictionaries(schema);
                  root = VectorSchemaRoot.create(schema, allocator);
                  writer = new ArrowFileWriter(root, null, file);
                  writer.start();
                } else if (!root.getSchema().equals(schema)) {
                  throw new IOException("endpoints disagree on the schema: " + schema);
                }
                break;
              }
            case MessageHeader.RecordBatch:
              {
                if (!schemaSeen) {
                  throw new IOException("a record batch before the schema message");
                }
                // deserializeRecordBatch takes the body's reference: the batch's buffers are
                // slices of it, released with the batch.
                ArrowBuf body = body(allocator, data.getDataBody());
                try (ArrowRecordBatch batch =
                    MessageSerializer.deserializeRecordBatch(message, body)) {
                  new VectorLoader(root).load(batch);
                }
                writer.writeBatch();
                rows += root.getRowCount();
                batches += 1;
                break;
              }
            default:
              throw new IOException(
                  "unexpected IPC message " + MessageHeader.name(message.headerType()));
          }
        }
        if (!schemaSeen) {
          throw new IOException("a DoGet stream without a schema message");
        }
      }
      if (writer == null) {
        throw new IOException("no endpoints");
      }
      writer.end();
    } finally {
      if (writer != null) {
        writer.close();
      }
      if (root != null) {
        root.close();
      }
      file.close();
    }
    System.out.printf(
        "{\"endpoints\": %d, \"batches\": %d, \"rows\": %d}%n",
        info.getEndpointCount(), batches, rows);
  }

  private static ArrowBuf body(BufferAllocator allocator, ByteString bytes) {
    ArrowBuf buf = allocator.buffer(bytes.size());
    buf.setBytes(0, bytes.asReadOnlyByteBuffer());
    return buf;
  }

  private static void refuseDictionaries(Schema schema) throws IOException {
    for (Field field : schema.getFields()) {
      if (field.getDictionary() != null) {
        throw new IOException("dictionary-encoded columns are not handled: " + field.getName());
      }
    }
  }

  private void put(BufferAllocator allocator, String name, Path in) throws Exception {
    CompletableFuture<List<Flight.PutResult>> done = new CompletableFuture<>();
    List<Flight.PutResult> results = new ArrayList<>();
    StreamObserver<Flight.FlightData> requests =
        FlightServiceGrpc.newStub(channel(uri))
            .withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers))
            .doPut(
                new StreamObserver<Flight.PutResult>() {
                  @Override
                  public void onNext(Flight.PutResult result) {
                    results.add(result);
                  }

                  @Override
                  public void onError(Throwable t) {
                    done.completeExceptionally(t);
                  }

                  @Override
                  public void onCompleted() {
                    done.complete(results);
                  }
                });
    try (FileChannel file = FileChannel.open(in, StandardOpenOption.READ);
        ArrowFileReader reader = new ArrowFileReader(file, allocator)) {
      VectorSchemaRoot root = reader.getVectorSchemaRoot();
      refuseDictionaries(root.getSchema());
      // The first message carries the descriptor and the schema; then one message a batch.
      requests.onNext(
          Flight.FlightData.newBuilder()
              .setFlightDescriptor(path(name))
              .setDataHeader(
                  ByteString.copyFrom(
                      MessageSerializer.serializeMetadata(root.getSchema(), IpcOption.DEFAULT)))
              .build());
      while (reader.loadNextBatch()) {
        try (ArrowRecordBatch batch = new VectorUnloader(root).getRecordBatch()) {
          ByteArrayOutputStream body = new ByteArrayOutputStream();
          MessageSerializer.writeBatchBuffers(new WriteChannel(Channels.newChannel(body)), batch);
          requests.onNext(
              Flight.FlightData.newBuilder()
                  .setDataHeader(
                      ByteString.copyFrom(
                          MessageSerializer.serializeMetadata(batch, IpcOption.DEFAULT)))
                  .setDataBody(ByteString.copyFrom(body.toByteArray()))
                  .build());
        }
      }
    } catch (Exception e) {
      requests.onError(e); // cancels the call: the server discards the put
      throw e;
    }
    requests.onCompleted(); // the end of the stream: the server commits the put now
    try {
      for (Flight.PutResult result : done.get(60, TimeUnit.SECONDS)) {
        System.out.println(result.getAppMetadata().toStringUtf8());
      }
    } catch (ExecutionException e) {
      if (e.getCause() instanceof StatusRuntimeException) {
        throw (StatusRuntimeException) e.getCause();
      }
      throw e;
    }
  }

  private void close() throws InterruptedException {
    for (ManagedChannel channel : channels.values()) {
      channel.shutdown().awaitTermination(5, TimeUnit.SECONDS);
    }
  }
}
