#include <mpi.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "shmem/heap.h"

namespace epserve::shmem {
namespace {

TEST(SymmetricHeap, OffsetsAgreeOnEveryRank) {
  absl::StatusOr<std::unique_ptr<SymmetricHeap>> heap =
      SymmetricHeap::Create(MPI_COMM_WORLD, 1 << 16);
  ASSERT_TRUE(heap.ok()) << heap.status();
  std::vector<unsigned long> offsets;
  for (size_t bytes : {3, 100, 4096, 17}) {
    absl::StatusOr<size_t> off = (*heap)->Allocate(bytes, 64);
    ASSERT_TRUE(off.ok());
    EXPECT_EQ(*off % 64, 0u);
    offsets.push_back(*off);
  }
  std::vector<unsigned long> all(offsets.size() * (*heap)->num_ranks());
  MPI_Allgather(offsets.data(), offsets.size(), MPI_UNSIGNED_LONG, all.data(), offsets.size(),
                MPI_UNSIGNED_LONG, MPI_COMM_WORLD);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], offsets[i % offsets.size()]);
  EXPECT_EQ((*heap)->Allocate(1 << 20).status().code(), absl::StatusCode::kResourceExhausted);
}

// Every rank stores rows that encode (source rank, destination rank, index) into every
// peer's segment, then signals; every rank checks what landed in its own segment.
TEST(SymmetricHeap, StoresIntoPeersArriveWithTheirSignal) {
  absl::StatusOr<std::unique_ptr<SymmetricHeap>> heap =
      SymmetricHeap::Create(MPI_COMM_WORLD, 1 << 20);
  ASSERT_TRUE(heap.ok()) << heap.status();
  SymmetricHeap& h = **heap;
  const int n = h.num_ranks(), me = h.rank();
  constexpr int kPerPeer = 1000;
  const size_t data = *h.Allocate(sizeof(int64_t) * kPerPeer * n);
  const size_t flags = *h.Allocate(64 * n);
  // Poison my segment's data region.
  int64_t* mine = h.As<int64_t>(me, data);
  std::fill(mine, mine + kPerPeer * n, -1);
  MPI_Barrier(MPI_COMM_WORLD);
  for (int round = 1; round <= 3; ++round) {
    for (int peer = 0; peer < n; ++peer) {
      int64_t* dst = h.As<int64_t>(peer, data) + me * kPerPeer;
      for (int i = 0; i < kPerPeer; ++i)
        dst[i] = (int64_t{round} << 48) | (me << 24) | (peer << 16) | i;
      SignalStore(h.As<uint64_t>(peer, flags + 64 * me), round);
    }
    // No early return: every rank must reach the barrier whatever it finds.
    int wrong = 0;
    for (int src = 0; src < n; ++src) {
      absl::Status s = WaitAtLeast(h.As<uint64_t>(me, flags + 64 * src), round,
                                   absl::Now() + absl::Seconds(30), "peer rows");
      EXPECT_TRUE(s.ok()) << s;
      for (int i = 0; i < kPerPeer; ++i) {
        wrong +=
            mine[src * kPerPeer + i] != ((int64_t{round} << 48) | (src << 24) | (me << 16) | i);
      }
    }
    EXPECT_EQ(wrong, 0) << "round " << round << " on rank " << me;
    MPI_Barrier(MPI_COMM_WORLD);  // nobody starts the next round while others still read
  }
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

}  // namespace
}  // namespace epserve::shmem
