/**
 * @file detail/serialize.hpp
 * @brief What the persistent formats share (the index's `save_index`/`load_index` in
 * `detail/index/serialize.hpp`, the store's `save_store`/`load_store` in `snapshot.hpp`, the
 * memory facade's manifest): CRC-64/XZ, little-endian field access, a checksumming buffered file
 * writer that removes its file when abandoned, an atomic replace (rename, then sync of the
 * directory), and checksumming readers. Plain C++17 and POSIX (fsync, open of a directory); no
 * CUDA.
 *
 * CRC-64/XZ: the ECMA-182 polynomial 0x42F0E1EBA9EA3693 bit-reflected (0xC96C5795D7870F42),
 * initial value and final XOR all ones; `crc64("123456789")` is 0x995DC9BBDF1939FA. A CRC of
 * width 64 detects every error burst of at most 64 bits, so every single-byte corruption of a
 * checksummed range is detected. It is computed eight bytes at a time from tables ("slicing by
 * 8", about 1 to 1.5 GB/s on one core of the 2-core Xeon CI machine) or, on x86-64 processors
 * with PCLMULQDQ (checked at run time), by folding 64 bytes at a time with carry-less
 * multiplications (the method of Intel's "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ"; 6 to 8 GB/s there), the last 16 bytes and the tail then going through the tables;
 * both give the same values.
 *
 * Every message starts with the caller's name (`who`: "save_index", "load_store('a.iskv')", ...)
 * so an error says which operation and which file failed.
 */
#pragma once

#include <inferscale/error.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define INFERSCALE_CRC64_CLMUL 1
#include <immintrin.h>  // PCLMULQDQ folding (chosen at run time, see crc64)
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>     // open (a directory, to sync it)
#include <sys/stat.h>  // fstat
#include <unistd.h>    // fsync, close
#endif

namespace inferscale::detail::serial {

// -------------------------------------------------------------------------------------------------
// CRC-64/XZ, table-driven eight bytes at a time ("slicing by 8").

/// @brief `table[k][b]`: the CRC register contribution of byte `b` followed by `k` zero bytes.
struct crc64_tables {
  std::uint64_t table[8][256];
};

inline crc64_tables const& crc64_lookup()
{
  static crc64_tables const tables = [] {
    constexpr std::uint64_t reflected_polynomial = 0xC96C5795D7870F42ull;
    crc64_tables t{};
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint64_t r = b;
      for (int bit = 0; bit < 8; ++bit) {
        r = (r & 1u) != 0 ? (r >> 1) ^ reflected_polynomial : r >> 1;
      }
      t.table[0][b] = r;
    }
    for (int k = 1; k < 8; ++k) {
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint64_t const prev = t.table[k - 1][b];
        t.table[k][b]            = (prev >> 8) ^ t.table[0][prev & 0xFFu];
      }
    }
    return t;
  }();
  return tables;
}

/// @brief CRC-64/XZ register update by the tables, eight bytes at a time.
inline std::uint64_t crc64_tables_update(std::uint64_t r, unsigned char const* p, std::size_t bytes)
{
  auto const& t = crc64_lookup().table;
  while (bytes >= 8) {
    std::uint64_t word = 0;  // little-endian load: the reflected CRC consumes byte 0 first
    for (int i = 7; i >= 0; --i) {
      word = (word << 8) | p[i];
    }
    word ^= r;
    r = t[7][word & 0xFFu] ^ t[6][(word >> 8) & 0xFFu] ^ t[5][(word >> 16) & 0xFFu] ^
        t[4][(word >> 24) & 0xFFu] ^ t[3][(word >> 32) & 0xFFu] ^ t[2][(word >> 40) & 0xFFu] ^
        t[1][(word >> 48) & 0xFFu] ^ t[0][word >> 56];
    p += 8;
    bytes -= 8;
  }
  for (; bytes > 0; --bytes, ++p) {
    r = (r >> 8) ^ t[0][(r ^ *p) & 0xFFu];
  }
  return r;
}

#if defined(INFERSCALE_CRC64_CLMUL)
/**
 * @brief Folding constants: for a fold over `D` bits, the low half of a 128-bit block (its first
 * 8 bytes, the higher powers) is multiplied by x^(D+63) mod P and the high half by x^(D-1) mod P,
 * both bit-reflected (one power less than the shift because a carry-less product of reflected
 * operands comes out multiplied by x). Computed once from the polynomial.
 */
struct crc64_fold_constants {
  std::uint64_t k[4][2];  ///< [fold over 128, 256, 384, 512 bits][low half, high half]
};

inline crc64_fold_constants const& crc64_folding()
{
  static crc64_fold_constants const constants = [] {
    auto const reflected_x_power = [](unsigned n) {
      std::uint64_t r = 1;  // x^0, normal representation, reduced by x^64 + 0x42F0E1EBA9EA3693
      for (unsigned i = 0; i < n; ++i) {
        bool const carry = (r >> 63) != 0;
        r <<= 1;
        if (carry) { r ^= 0x42F0E1EBA9EA3693ull; }
      }
      std::uint64_t reflected = 0;
      for (int b = 0; b < 64; ++b) {
        reflected |= ((r >> b) & 1u) << (63 - b);
      }
      return reflected;
    };
    crc64_fold_constants c{};
    for (unsigned j = 0; j < 4; ++j) {
      unsigned const bits = 128 * (j + 1);
      c.k[j][0]           = reflected_x_power(bits + 63);
      c.k[j][1]           = reflected_x_power(bits - 1);
    }
    return c;
  }();
  return constants;
}

inline bool crc64_has_clmul() noexcept
{
  static bool const has = __builtin_cpu_supports("pclmul") != 0;
  return has;
}

/// @brief `a` moved forward over the bits whose constants `k` holds (low half, high half).
__attribute__((target("pclmul,sse2"))) inline __m128i crc64_fold(__m128i a, __m128i k)
{
  return _mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11));
}

/// @brief CRC-64/XZ register update by folding (`bytes` >= 64).
__attribute__((target("pclmul,sse2"))) inline std::uint64_t crc64_clmul_update(
  std::uint64_t r, unsigned char const* p, std::size_t bytes)
{
  crc64_fold_constants const& c = crc64_folding();
#define INFERSCALE_CRC64_CONSTANT(j) \
  _mm_set_epi64x(static_cast<long long>(c.k[j][1]), static_cast<long long>(c.k[j][0]))
#define INFERSCALE_CRC64_LOAD(q) _mm_loadu_si128(reinterpret_cast<__m128i const*>(q))
  // the register's state is the same as XOR-ing it into the next 8 message bytes
  __m128i a0 =
    _mm_xor_si128(INFERSCALE_CRC64_LOAD(p), _mm_set_epi64x(0, static_cast<long long>(r)));
  __m128i a1 = INFERSCALE_CRC64_LOAD(p + 16);
  __m128i a2 = INFERSCALE_CRC64_LOAD(p + 32);
  __m128i a3 = INFERSCALE_CRC64_LOAD(p + 48);
  p += 64;
  bytes -= 64;
  __m128i const k512 = INFERSCALE_CRC64_CONSTANT(3);
  while (bytes >= 64) {
    a0 = _mm_xor_si128(crc64_fold(a0, k512), INFERSCALE_CRC64_LOAD(p));
    a1 = _mm_xor_si128(crc64_fold(a1, k512), INFERSCALE_CRC64_LOAD(p + 16));
    a2 = _mm_xor_si128(crc64_fold(a2, k512), INFERSCALE_CRC64_LOAD(p + 32));
    a3 = _mm_xor_si128(crc64_fold(a3, k512), INFERSCALE_CRC64_LOAD(p + 48));
    p += 64;
    bytes -= 64;
  }
  __m128i const k128 = INFERSCALE_CRC64_CONSTANT(0);
  __m128i acc        = _mm_xor_si128(_mm_xor_si128(crc64_fold(a0, INFERSCALE_CRC64_CONSTANT(2)),
                                            crc64_fold(a1, INFERSCALE_CRC64_CONSTANT(1))),
                              _mm_xor_si128(crc64_fold(a2, k128), a3));
  while (bytes >= 16) {
    acc = _mm_xor_si128(crc64_fold(acc, k128), INFERSCALE_CRC64_LOAD(p));
    p += 16;
    bytes -= 16;
  }
#undef INFERSCALE_CRC64_CONSTANT
#undef INFERSCALE_CRC64_LOAD
  // acc is congruent to the message so far: its 16 bytes, then the tail, through the tables
  unsigned char rest[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(rest), acc);
  return crc64_tables_update(crc64_tables_update(0, rest, 16), p, bytes);
}
#endif

/// @brief An incremental CRC-64/XZ (see the file comment).
class crc64 {
 public:
  void update(void const* data, std::size_t bytes) noexcept
  {
    unsigned char const* p = static_cast<unsigned char const*>(data);
#if defined(INFERSCALE_CRC64_CLMUL)
    if (bytes >= 256 && crc64_has_clmul()) {
      register_ = crc64_clmul_update(register_, p, bytes);
      return;
    }
#endif
    register_ = crc64_tables_update(register_, p, bytes);
  }
  std::uint64_t value() const noexcept { return ~register_; }

 private:
  std::uint64_t register_{~std::uint64_t{0}};
};

/// @brief The table-driven CRC-64/XZ of a byte range (the reference the folding is tested
/// against).
inline std::uint64_t crc64_by_tables(void const* data, std::size_t bytes) noexcept
{
  return ~crc64_tables_update(~std::uint64_t{0}, static_cast<unsigned char const*>(data), bytes);
}

/// @brief CRC-64/XZ of a byte range.
inline std::uint64_t crc64_of(void const* data, std::size_t bytes) noexcept
{
  crc64 c;
  c.update(data, bytes);
  return c.value();
}

// -------------------------------------------------------------------------------------------------
// Little-endian helpers and message text.

inline bool host_is_little_endian() noexcept
{
  std::uint16_t const one = 1;
  unsigned char first     = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

/// @brief Copies `count` elements of `width` bytes between host order and little-endian (the
/// same operation both ways: a copy on a little-endian host, a byte reversal per element else).
inline void copy_little_endian(void* dst, void const* src, std::size_t count, std::size_t width)
{
  if (count == 0) { return; }
  if (width == 1 || host_is_little_endian()) {
    std::memcpy(dst, src, count * width);
    return;
  }
  auto* d       = static_cast<unsigned char*>(dst);
  auto const* s = static_cast<unsigned char const*>(src);
  for (std::size_t e = 0; e < count; ++e) {
    for (std::size_t b = 0; b < width; ++b) {
      d[e * width + b] = s[e * width + width - 1 - b];
    }
  }
}

/// @brief Writes `value` as `sizeof(T)` little-endian bytes.
template <class T>
void put_le(unsigned char* dst, T value) noexcept
{
  auto const bits = static_cast<std::uint64_t>(value);
  for (std::size_t b = 0; b < sizeof(T); ++b) {
    dst[b] = static_cast<unsigned char>(bits >> (8 * b));
  }
}

/// @brief Reads `sizeof(T)` little-endian bytes.
template <class T>
T get_le(unsigned char const* src) noexcept
{
  std::uint64_t bits = 0;
  for (std::size_t b = sizeof(T); b-- > 0;) {
    bits = (bits << 8) | src[b];
  }
  return static_cast<T>(bits);
}

inline std::string errno_text(int error) { return std::strerror(error); }

/// @brief `v` in hexadecimal with `digits` digits ("0x0000abcd").
inline std::string hex(std::uint64_t v, int digits = 16)
{
  char text[24];
  std::snprintf(text, sizeof text, "0x%0*llx", digits, static_cast<unsigned long long>(v));
  return text;
}

/// @brief `a * b + c` unless it overflows 64 bits (then false).
inline bool multiply_add(std::uint64_t a,
                         std::uint64_t b,
                         std::uint64_t c,
                         std::uint64_t& out) noexcept
{
  std::uint64_t const max = ~std::uint64_t{0};
  if (a != 0 && b > max / a) { return false; }
  std::uint64_t const product = a * b;
  if (product > max - c) { return false; }
  out = product + c;
  return true;
}

// -------------------------------------------------------------------------------------------------
// Writing: a buffered file that checksums what it writes and cleans up after a failure.

/**
 * @brief Creates `path` (truncating it), checksums everything written, and on `finish()` flushes,
 * syncs and closes it. Destroyed unfinished (an exception on the way), it closes and removes the
 * file, so a failed save leaves no partial file behind.
 */
class checksummed_writer {
 public:
  checksummed_writer(std::string path, std::string who)
    : path_(std::move(path)), who_(std::move(who))
  {
    file_           = std::fopen(path_.c_str(), "wb");
    int const error = errno;  // before anything else can change it
    INFERSCALE_EXPECTS(file_ != nullptr,
                       who_ + ": cannot create '" + path_ + "': " + errno_text(error));
    buffer_.reserve(buffer_bytes);
  }
  checksummed_writer(checksummed_writer const&)            = delete;
  checksummed_writer& operator=(checksummed_writer const&) = delete;
  /// Abandons an unfinished file (closed and removed); never throws.
  ~checksummed_writer()
  {
    if (file_ != nullptr) {
      (void)std::fclose(file_);
      (void)std::remove(path_.c_str());
    }
  }

  void write(void const* data, std::size_t bytes)
  {
    checksum_.update(data, bytes);
    write_excluded(data, bytes);
  }

  /**
   * Writes bytes that the running checksum leaves out. A format whose file checksum follows
   * embedded checksums needs this: CRC-64 is affine, so a range followed by its own CRC-64 leaves
   * the register in a state that does not depend on the range's contents, and a file checksum
   * over it would not depend on them either.
   */
  void write_excluded(void const* data, std::size_t bytes)
  {
    auto const* p = static_cast<unsigned char const*>(data);
    if (bytes >= buffer_bytes) {  // large blocks (pool pages) go to the file without a copy
      flush_buffer();
      fail_if(std::fwrite(p, 1, bytes, file_) != bytes, "cannot write");
      return;
    }
    while (bytes > 0) {
      std::size_t const n = std::min(bytes, buffer_bytes - buffer_.size());
      buffer_.insert(buffer_.end(), p, p + n);
      p += n;
      bytes -= n;
      if (buffer_.size() == buffer_bytes) { flush_buffer(); }
    }
  }

  /// Writes `count` elements of `width` bytes, little-endian.
  void write_elements(void const* data, std::size_t count, std::size_t width)
  {
    if (width == 1 || host_is_little_endian()) {
      write(data, count * width);
      return;
    }
    std::vector<unsigned char> converted(4096 * width);
    auto const* p = static_cast<unsigned char const*>(data);
    for (std::size_t done = 0; done < count; done += 4096) {
      std::size_t const n = std::min<std::size_t>(4096, count - done);
      copy_little_endian(converted.data(), p + done * width, n, width);
      write(converted.data(), n * width);
    }
  }

  /// CRC-64 of every byte written so far.
  std::uint64_t checksum() const noexcept { return checksum_.value(); }

  /// Flushes, syncs to the storage device and closes; the file is complete when this returns.
  void finish()
  {
    flush_buffer();
    fail_if(std::fflush(file_) != 0, "cannot write");
#if defined(__unix__) || defined(__APPLE__)
    fail_if(::fsync(::fileno(file_)) != 0, "cannot sync");
#endif
    std::FILE* const file = file_;
    file_                 = nullptr;
    if (std::fclose(file) != 0) {
      int const error = errno;
      (void)std::remove(path_.c_str());
      INFERSCALE_FAIL(who_ + ": cannot close '" + path_ + "': " + errno_text(error));
    }
  }

 private:
  static constexpr std::size_t buffer_bytes = std::size_t{1} << 20;

  void flush_buffer()
  {
    if (buffer_.empty()) { return; }
    fail_if(std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size(),
            "cannot write");
    buffer_.clear();
  }

  void fail_if(bool failed, char const* what)
  {
    if (failed) {
      int const error = errno;
      INFERSCALE_FAIL(who_ + ": " + what + " '" + path_ + "': " + errno_text(error));
    }
  }

  std::string path_;
  std::string who_;
  std::FILE* file_{nullptr};
  std::vector<unsigned char> buffer_;
  crc64 checksum_;
};

/// @brief The directory part of `path` ("." when it has none).
inline std::string directory_of(std::string const& path)
{
  std::size_t const slash = path.find_last_of('/');
  if (slash == std::string::npos) { return "."; }
  if (slash == 0) { return "/"; }
  return path.substr(0, slash);
}

/**
 * @brief Syncs the directory holding `path`, so a rename into it survives a crash (POSIX: the
 * new directory entry is durable only once the directory itself is synced).
 * @throw logic_error when the directory cannot be opened or synced; a file system that cannot
 * sync directories at all (EINVAL, ENOTSUP) is accepted as it is.
 */
inline void sync_directory_of(std::string const& path, std::string const& who)
{
#if defined(__unix__) || defined(__APPLE__)
  std::string const directory = directory_of(path);
  int const fd                = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  int const open_error        = errno;
  INFERSCALE_EXPECTS(
    fd >= 0,
    who + ": cannot open directory '" + directory + "' to sync it: " + errno_text(open_error));
  int const synced     = ::fsync(fd);
  int const sync_error = errno;
  (void)::close(fd);
  INFERSCALE_EXPECTS(
    synced == 0 || sync_error == EINVAL || sync_error == ENOTSUP,
    who + ": cannot sync directory '" + directory + "': " + errno_text(sync_error));
#else
  (void)path;
  (void)who;
#endif
}

/**
 * @brief Renames `from` to `to` (replacing it); on failure removes `from` and throws.
 * @throw logic_error naming `who`, both paths and the system's reason
 */
inline void rename_or_fail(std::string const& from, std::string const& to, std::string const& who)
{
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    int const error = errno;
    (void)std::remove(from.c_str());
    INFERSCALE_FAIL(who + ": cannot rename '" + from + "' to '" + to + "': " + errno_text(error));
  }
}

/**
 * @brief The 64-bit little-endian checksum stored at byte `offset` of a saved file (a negative
 * offset counts from the end: -8 is the trailing file checksum). Reads 8 bytes only, so a
 * manifest can check which file it names before that file is loaded.
 * @throw logic_error naming `who` and the path when the file cannot be opened or is too short
 */
inline std::uint64_t stored_checksum(std::string const& path, long offset, std::string const& who)
{
  std::FILE* file = std::fopen(path.c_str(), "rb");
  int const error = errno;
  INFERSCALE_EXPECTS(file != nullptr, who + ": cannot open '" + path + "': " + errno_text(error));
  unsigned char bytes[8] = {};
  bool const read        = std::fseek(file, offset, offset < 0 ? SEEK_END : SEEK_SET) == 0 &&
                    std::fread(bytes, 1, 8, file) == 8;
  (void)std::fclose(file);
  INFERSCALE_EXPECTS(
    read,
    who + ": cannot read the checksum at byte " + std::to_string(offset) + " of '" + path + "'");
  return get_le<std::uint64_t>(bytes);
}

/// @brief `v` as 16 lower-case hexadecimal digits (file names after checksums).
inline std::string checksum_digits(std::uint64_t v)
{
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
  return text;
}

/**
 * @brief Writes a file atomically: `write(out)` fills `path + ".tmp"` (a checksummed_writer, in
 * the same directory, so the rename never crosses file systems), which is then synced, renamed
 * over `path` and, with `sync_directory`, the directory synced.
 *
 * On any failure the temporary is removed and `path` is left as it was (POSIX rename replaces
 * the destination atomically).
 * @return the CRC-64 of every byte written
 * @throw logic_error naming `who`, the path and the system's reason; whatever `write` throws
 */
template <class Write>
std::uint64_t write_file_atomically(std::string const& path,
                                    std::string const& who,
                                    bool sync_directory,
                                    Write&& write)
{
  std::string const temporary = path + ".tmp";
  std::uint64_t checksum      = 0;
  {
    checksummed_writer out{temporary, who};
    std::forward<Write>(write)(out);
    checksum = out.checksum();
    out.finish();
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    int const error = errno;
    (void)std::remove(temporary.c_str());
    INFERSCALE_FAIL(who + ": cannot rename '" + temporary + "' to '" + path +
                    "': " + errno_text(error));
  }
  if (sync_directory) { sync_directory_of(path, who); }
  return checksum;
}

// -------------------------------------------------------------------------------------------------
// Reading.

/// @brief The whole file in memory. @throw logic_error naming `who`, the path and the reason.
inline std::vector<unsigned char> read_whole_file(std::string const& path, std::string const& who)
{
  std::FILE* file      = std::fopen(path.c_str(), "rb");
  int const open_error = errno;  // before anything else can change it
  INFERSCALE_EXPECTS(file != nullptr,
                     who + ": cannot open '" + path + "': " + errno_text(open_error));
  std::vector<unsigned char> bytes;
  std::size_t constexpr chunk = std::size_t{1} << 20;
  int error                   = 0;
  for (;;) {
    std::size_t const at = bytes.size();
    bytes.resize(at + chunk);
    errno                 = 0;
    std::size_t const got = std::fread(bytes.data() + at, 1, chunk, file);
    if (got < chunk && std::ferror(file) != 0) { error = errno != 0 ? errno : EIO; }
    bytes.resize(at + got);
    if (got < chunk) { break; }
  }
  (void)std::fclose(file);
  INFERSCALE_EXPECTS(error == 0, who + ": cannot read '" + path + "': " + errno_text(error));
  return bytes;
}

/**
 * @brief Reads a file front to back in exact pieces, checksumming what it reads; its size is
 * known from the start (so a format can check the exact length before reading on).
 */
class checksummed_reader {
 public:
  checksummed_reader(std::string path, std::string who)
    : path_(std::move(path)), who_(std::move(who))
  {
    file_                = std::fopen(path_.c_str(), "rb");
    int const open_error = errno;
    INFERSCALE_EXPECTS(file_ != nullptr,
                       who_ + ": cannot open '" + path_ + "': " + errno_text(open_error));
    // unbuffered: the pieces are either tiny (header fields, read once) or large (pool pages)
    (void)std::setvbuf(file_, nullptr, _IONBF, 0);
#if defined(__unix__) || defined(__APPLE__)
    struct stat info {};
    if (::fstat(::fileno(file_), &info) != 0) {
      int const error = errno;
      (void)std::fclose(file_);
      file_ = nullptr;
      INFERSCALE_FAIL(who_ + ": cannot stat '" + path_ + "': " + errno_text(error));
    }
    size_ = static_cast<std::uint64_t>(info.st_size);
#else
    std::fseek(file_, 0, SEEK_END);
    size_ = static_cast<std::uint64_t>(std::ftell(file_));
    std::fseek(file_, 0, SEEK_SET);
#endif
  }
  checksummed_reader(checksummed_reader const&)            = delete;
  checksummed_reader& operator=(checksummed_reader const&) = delete;
  ~checksummed_reader()
  {
    if (file_ != nullptr) { (void)std::fclose(file_); }
  }

  std::uint64_t size() const noexcept { return size_; }
  std::uint64_t position() const noexcept { return position_; }
  /// CRC-64 of every byte read so far.
  std::uint64_t checksum() const noexcept { return checksum_.value(); }

  /// Reads exactly `bytes` bytes (the caller has checked the length against size()).
  void read(void* data, std::size_t bytes)
  {
    read_excluded(data, bytes);
    checksum_.update(data, bytes);
  }

  /// Reads exactly `bytes` bytes that the running checksum leaves out (see
  /// checksummed_writer::write_excluded).
  void read_excluded(void* data, std::size_t bytes)
  {
    if (bytes == 0) { return; }
    errno                 = 0;
    std::size_t const got = std::fread(data, 1, bytes, file_);
    int const error       = errno;
    INFERSCALE_EXPECTS(got == bytes,
                       who_ + ": cannot read '" + path_ + "' at byte " +
                         std::to_string(position_ + got) + ": " +
                         (std::ferror(file_) != 0 ? errno_text(error != 0 ? error : EIO)
                                                  : std::string{"the file became shorter"}));
    position_ += bytes;
  }

  /// Reads exactly `bytes` bytes at `offset` (pread: neither the position nor the running
  /// checksum moves), for a reader that takes only some ranges of the file.
  void read_at(void* data, std::size_t bytes, std::uint64_t offset)
  {
    auto* p         = static_cast<unsigned char*>(data);
    std::size_t got = 0;
    int error       = 0;
    while (got < bytes) {
#if defined(__unix__) || defined(__APPLE__)
      ssize_t const n =
        ::pread(::fileno(file_), p + got, bytes - got, static_cast<off_t>(offset + got));
      if (n < 0 && errno == EINTR) { continue; }
      if (n <= 0) {
        error = n < 0 ? errno : 0;
        break;
      }
      got += static_cast<std::size_t>(n);
#else
      errno = 0;
      if (std::fseek(file_, static_cast<long>(offset + got), SEEK_SET) != 0) {
        error = errno != 0 ? errno : EIO;
        break;
      }
      std::size_t const n = std::fread(p + got, 1, bytes - got, file_);
      if (n == 0) {
        error = std::ferror(file_) != 0 ? (errno != 0 ? errno : EIO) : 0;
        break;
      }
      got += n;
#endif
    }
    INFERSCALE_EXPECTS(got == bytes,
                       who_ + ": cannot read '" + path_ + "' at byte " +
                         std::to_string(offset + got) + ": " +
                         (error != 0 ? errno_text(error) : std::string{"the file became shorter"}));
  }

 private:
  std::string path_;
  std::string who_;
  std::FILE* file_{nullptr};
  std::uint64_t size_{0};
  std::uint64_t position_{0};
  crc64 checksum_;
};

}  // namespace inferscale::detail::serial
