// The symmetric heap, both backends, across real ranks.
#include <mpi.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shmem/heap.h"
#include "shmem/peer_memory.h"

namespace epserve::shmem {
namespace {

class HeapTest : public ::testing::TestWithParam<HeapBackend> {
 protected:
  std::unique_ptr<SymmetricHeap> Make(size_t bytes) {
    absl::StatusOr<std::unique_ptr<SymmetricHeap>> heap =
        SymmetricHeap::Create(MPI_COMM_WORLD, bytes, GetParam());
    EXPECT_TRUE(heap.ok()) << heap.status();
    return heap.ok() ? *std::move(heap) : nullptr;
  }
};

TEST_P(HeapTest, OffsetsAgreeOnEveryRank) {
  std::unique_ptr<SymmetricHeap> heap = Make(1 << 16);
  ASSERT_NE(heap, nullptr);
  EXPECT_EQ(heap->backend(), GetParam());
  std::vector<unsigned long> offsets;
  for (size_t bytes : {3, 100, 4096, 17}) {
    absl::StatusOr<size_t> off = heap->Allocate(bytes, 64);
    ASSERT_TRUE(off.ok());
    EXPECT_EQ(*off % 64, 0u);
    offsets.push_back(*off);
  }
  std::vector<unsigned long> all(offsets.size() * heap->num_ranks());
  MPI_Allgather(offsets.data(), offsets.size(), MPI_UNSIGNED_LONG, all.data(), offsets.size(),
                MPI_UNSIGNED_LONG, MPI_COMM_WORLD);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], offsets[i % offsets.size()]);
  EXPECT_EQ(heap->Allocate(1 << 20).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(heap->Allocate(8, 3).status().code(), absl::StatusCode::kInvalidArgument);
  // Direct access: every peer on shm, only this rank on rma.
  for (int r = 0; r < heap->num_ranks(); ++r) {
    const bool direct = heap->Direct(r, 0) != nullptr;
    EXPECT_EQ(direct, GetParam() == HeapBackend::kShm || r == heap->rank()) << "rank " << r;
  }
}

// Every rank puts rows that encode (round, source rank, destination rank, index) into every
// peer's segment, then signals; every rank checks what landed in its own segment, with no
// barrier between rounds: a rank overwrites a peer's rows only after that peer said (with
// an acknowledgement signal) that it has read them.
TEST_P(HeapTest, PutsArriveWithTheirSignalRoundAfterRound) {
  std::unique_ptr<SymmetricHeap> heap = Make(1 << 20);
  ASSERT_NE(heap, nullptr);
  SymmetricHeap& h = *heap;
  const int n = h.num_ranks(), me = h.rank();
  constexpr int kPerPeer = 1000;
  const size_t data = *h.Allocate(sizeof(int64_t) * kPerPeer * n);
  const size_t flags = *h.Allocate(64 * n);
  const size_t acks = *h.Allocate(64 * n);
  int64_t* mine = h.LocalAs<int64_t>(data);
  std::fill(mine, mine + kPerPeer * n, -1);
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<int64_t> rows(kPerPeer);
  int wrong = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int round = 1; round <= 20; ++round) {
    for (int peer = 0; peer < n; ++peer) {
      // The peer read my rows of the previous round.
      ASSERT_TRUE(h.WaitSignal(acks + 64 * peer, round - 1, deadline, "ack from", peer).ok());
      for (int i = 0; i < kPerPeer; ++i) {
        rows[i] = (int64_t{round} << 48) | (int64_t{me} << 32) | (peer << 16) | i;
      }
      ASSERT_TRUE(h.Put(peer, data + sizeof(int64_t) * kPerPeer * me, rows.data(),
                        rows.size() * sizeof(int64_t))
                      .ok());
      ASSERT_TRUE(h.SignalSet(peer, flags + 64 * me, round).ok());
    }
    for (int src = 0; src < n; ++src) {
      absl::Status s = h.WaitSignal(flags + 64 * src, round, deadline, "rows from", src);
      ASSERT_TRUE(s.ok()) << s;
      for (int i = 0; i < kPerPeer; ++i) {
        wrong += mine[src * kPerPeer + i] !=
                 ((int64_t{round} << 48) | (int64_t{src} << 32) | (me << 16) | i);
      }
      ASSERT_TRUE(h.SignalSet(src, acks + 64 * me, round).ok());
    }
  }
  EXPECT_EQ(wrong, 0) << "on rank " << me;
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_P(HeapTest, GetAndAtomicAddAcrossRanks) {
  std::unique_ptr<SymmetricHeap> heap = Make(1 << 16);
  ASSERT_NE(heap, nullptr);
  SymmetricHeap& h = *heap;
  const size_t counter = *h.Allocate(64);
  const size_t value = *h.Allocate(64);
  *h.LocalAs<int64_t>(value) = 1000 + h.rank();
  MPI_Barrier(MPI_COMM_WORLD);
  // Every rank adds (rank + 1) to every rank's counter, ten times.
  for (int i = 0; i < 10; ++i) {
    for (int r = 0; r < h.num_ranks(); ++r) {
      ASSERT_TRUE(h.SignalAdd(r, counter, h.rank() + 1).ok());
    }
  }
  const uint64_t expected = 10ull * h.num_ranks() * (h.num_ranks() + 1) / 2;
  EXPECT_TRUE(h.WaitSignal(counter, expected, absl::Now() + absl::Seconds(30), "adds").ok());
  EXPECT_EQ(h.SignalLoad(counter), expected);
  const int peer = (h.rank() + 1) % h.num_ranks();
  int64_t got = 0;
  ASSERT_TRUE(h.Get(peer, value, &got, sizeof(got)).ok());
  EXPECT_EQ(got, 1000 + peer);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_P(HeapTest, WaitEndsAtItsDeadline) {
  std::unique_ptr<SymmetricHeap> heap = Make(1 << 12);
  ASSERT_NE(heap, nullptr);
  const size_t never = *heap->Allocate(64);
  const absl::Time start = absl::Now();
  absl::Status s = heap->WaitSignal(never, 1, start + absl::Milliseconds(50), "a signal", 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("a signal 7"), absl::string_view::npos) << s;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(Backends, HeapTest,
                         ::testing::Values(HeapBackend::kShm, HeapBackend::kRma),
                         [](const ::testing::TestParamInfo<HeapBackend>& p) {
                           return std::string(HeapBackendName(p.param));
                         });

TEST(HeapBackend, ParsesTheFlag) {
  EXPECT_EQ(*ParseHeapBackend("auto"), HeapBackend::kAuto);
  EXPECT_EQ(*ParseHeapBackend("rma"), HeapBackend::kRma);
  absl::StatusOr<HeapBackend> bad = ParseHeapBackend("nvshmem");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--heap"), absl::string_view::npos);
}

TEST(HeapBackend, AutoPicksSharedMemoryOnOneHost) {
  absl::StatusOr<std::unique_ptr<SymmetricHeap>> heap =
      SymmetricHeap::Create(MPI_COMM_WORLD, 4096, HeapBackend::kAuto);
  ASSERT_TRUE(heap.ok()) << heap.status();
  EXPECT_EQ((*heap)->backend(), HeapBackend::kShm);
}

TEST(Signals, WaitEndsAtItsDeadlineOrWhenCancelled) {
  uint64_t signal = 0;
  const absl::Time start = absl::Now();
  absl::Status s = WaitAtLeast(&signal, 1, start + absl::Milliseconds(50), "a signal nobody sets");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("a signal nobody sets"), absl::string_view::npos);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  std::atomic<bool> cancel{true};
  EXPECT_EQ(
      WaitAtLeast(&signal, 1, absl::InfiniteFuture(), "x", absl::Microseconds(50), &cancel).code(),
      absl::StatusCode::kCancelled);
  SignalStore(&signal, 5);
  EXPECT_TRUE(WaitAtLeast(&signal, 5, absl::Now(), "set").ok());
  EXPECT_EQ(SignalAdd(&signal, 2), 7u);
}

TEST(Signals, ProportionalSleepSeesTheSignalAndKeepsTheDeadline) {
  uint64_t signal = 0;
  WaitOptions wait;
  wait.sleep_fraction = 1.0 / 64;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    SignalStore(&signal, 1);
  });
  absl::Time start = absl::Now();
  EXPECT_TRUE(WaitAtLeast(&signal, 1, start + absl::Seconds(30), "a late signal", wait).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  setter.join();
  // Sleeps that double up to 4x the time waited so far overshoot a 300 ms deadline by up to
  // about 300 ms unless they are cut at the deadline; the wait still ends at the deadline.
  wait.sleep_fraction = 4.0;
  start = absl::Now();
  absl::Status s = WaitAtLeast(&signal, 2, start + absl::Milliseconds(300), "nobody", wait);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(550));
}

// ---- PeerMemory: pieces every member makes and every member addresses ----

// A group of every rank of a fresh shm heap, with its rendezvous words.
struct PeerHeap {
  std::unique_ptr<SymmetricHeap> heap;
  PeerGroup group;
  PeerHeap() {
    absl::StatusOr<std::unique_ptr<SymmetricHeap>> h =
        SymmetricHeap::Create(MPI_COMM_WORLD, 1 << 16, HeapBackend::kShm);
    EXPECT_TRUE(h.ok()) << h.status();
    heap = *std::move(h);
    group.heap = heap.get();
    group.first_rank = 0;
    group.size = heap->num_ranks();
    group.me = heap->rank();
    group.rendezvous = *heap->Allocate(64 * group.size);
  }
};

// Every member writes its own pieces, then every member reads every member's and writes into
// its right neighbour's second piece, which the neighbour reads: host memory shared across the
// processes through the descriptors passed over the sockets.
TEST(PeerMemory, EveryMemberAddressesEveryMembersPieces) {
  PeerHeap ph;
  const int n = ph.group.size, me = ph.group.me;
  unsigned seed = std::random_device{}();  // the same sizes on every member
  MPI_Bcast(&seed, 1, MPI_UNSIGNED, 0, MPI_COMM_WORLD);
  std::mt19937 rng(seed);
  const std::vector<size_t> sizes = {1 + rng() % 10000, 4096 * (1 + rng() % 40)};
  absl::StatusOr<std::unique_ptr<PeerMemory>> m = PeerMemory::Create(
      ph.group, PeerMemoryKind::kHost, sizes, "", absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(m.ok()) << m.status();
  PeerMemory& mem = **m;
  ASSERT_EQ(mem.members(), n);
  ASSERT_EQ(mem.pieces(), 2);
  for (int p = 0; p < 2; ++p) {
    EXPECT_GE(mem.bytes(p), sizes[p]);
    EXPECT_EQ(mem.bytes(p) % 4096, 0u);
  }
  auto word = [](int member, int piece, size_t i) {
    return static_cast<uint32_t>(member * 1000003 + piece * 7919 + i * 2654435761u);
  };
  for (int p = 0; p < 2; ++p) {
    auto* w = static_cast<uint32_t*>(mem.host(me, p));
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(w) % 4096, 0u);
    for (size_t i = 0; i < mem.bytes(p) / 4; ++i) w[i] = word(me, p, i);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (int d = 0; d < n; ++d) {
    for (int p = 0; p < 2; ++p) {
      EXPECT_GE(mem.fd(d, p), 0);
      const auto* w = static_cast<const uint32_t*>(mem.host(d, p));
      size_t wrong = 0;
      for (size_t i = 0; i < mem.bytes(p) / 4; ++i) wrong += w[i] != word(d, p, i);
      EXPECT_EQ(wrong, 0u) << "member " << d << " piece " << p;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const int right = (me + 1) % n;
  auto* theirs = static_cast<uint32_t*>(mem.host(right, 1));
  for (size_t i = 0; i < mem.bytes(1) / 4; ++i) theirs[i] = word(100 + me, 1, i);
  MPI_Barrier(MPI_COMM_WORLD);
  const int left = (me + n - 1) % n;
  const auto* mine = static_cast<const uint32_t*>(mem.host(me, 1));
  size_t wrong = 0;
  for (size_t i = 0; i < mem.bytes(1) / 4; ++i) wrong += mine[i] != word(100 + left, 1, i);
  EXPECT_EQ(wrong, 0u);
  MPI_Barrier(MPI_COMM_WORLD);
}

// One member that cannot take part declines; every other member's Create fails at once,
// naming it (nobody waits out the deadline). A kind no member can make (CUDA memory where
// there is no CUDA device, or a build without it) fails every member alike.
TEST(PeerMemory, ADecliningMemberFailsEveryMemberAtOnce) {
  {
    PeerHeap ph;
    const int decliner = ph.group.size - 1;
    const absl::Time start = absl::Now();
    if (ph.group.me == decliner) {
      ASSERT_TRUE(PeerMemory::Decline(ph.group).ok());
    } else {
      absl::StatusOr<std::unique_ptr<PeerMemory>> m = PeerMemory::Create(
          ph.group, PeerMemoryKind::kHost, {4096}, "", absl::Now() + absl::Seconds(60));
      ASSERT_FALSE(m.ok());
      EXPECT_NE(m.status().message().find(absl::StrCat("member ", decliner, " could not")),
                absl::string_view::npos)
          << m.status();
      EXPECT_LT(absl::Now() - start, absl::Seconds(20));
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  {
    PeerHeap ph;
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<PeerMemory>> m =
        PeerMemory::Create(ph.group, PeerMemoryKind::kCuda, {1 << 20}, std::string(16, '\0'),
                           absl::Now() + absl::Seconds(60));
    EXPECT_FALSE(m.ok());  // no CUDA device has an all-zero UUID
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  {
    PeerHeap ph;
    EXPECT_EQ(
        PeerMemory::Create(ph.group, PeerMemoryKind::kHost, {}, "", absl::Now()).status().code(),
        absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace epserve::shmem
