// Regenerates the golden tables in test_key_groups.py and test_key_hashes.py from Java
// arithmetic, so the numpy ports are checked against real int/long semantics:
//   javac -d /tmp GoldenHashes.java && java -cp /tmp GoldenHashes
// keyGroupOperator follows Flink's KeyGroupRangeAssignment (assignToKeyGroup for a Long
// key, computeOperatorIndexForKeyGroup) and MathUtils.murmurHash; kafkaMurmur2 follows
// Kafka's org.apache.kafka.common.utils.Utils.murmur2.
import java.nio.charset.StandardCharsets;
import java.util.Random;

public class GoldenHashes {
    static int flinkMurmurHash(int code) {
        code *= 0xcc9e2d51;
        code = Integer.rotateLeft(code, 15);
        code *= 0x1b873593;
        code = Integer.rotateLeft(code, 13);
        code = code * 5 + 0xe6546b64;
        code ^= 4;
        code ^= code >>> 16;
        code *= 0x85ebca6b;
        code ^= code >>> 13;
        code *= 0xc2b2ae35;
        code ^= code >>> 16;
        if (code >= 0) {
            return code;
        } else if (code != Integer.MIN_VALUE) {
            return -code;
        } else {
            return 0;
        }
    }

    static int keyGroup(long keyHash, int maxParallelism) {
        return flinkMurmurHash(Long.valueOf(keyHash).hashCode()) % maxParallelism;
    }

    static int kafkaMurmur2(byte[] data) {
        int length = data.length;
        int m = 0x5bd1e995;
        int h = 0x9747b28c ^ length;
        for (int i = 0; i < length / 4; i++) {
            int i4 = i * 4;
            int k = (data[i4] & 0xff) + ((data[i4 + 1] & 0xff) << 8)
                    + ((data[i4 + 2] & 0xff) << 16) + ((data[i4 + 3] & 0xff) << 24);
            k *= m;
            k ^= k >>> 24;
            k *= m;
            h *= m;
            h ^= k;
        }
        switch (length % 4) {
            case 3:
                h ^= (data[(length & ~3) + 2] & 0xff) << 16;
            case 2:
                h ^= (data[(length & ~3) + 1] & 0xff) << 8;
            case 1:
                h ^= data[length & ~3] & 0xff;
                h *= m;
        }
        h ^= h >>> 13;
        h *= m;
        h ^= h >>> 15;
        return h;
    }

    public static void main(String[] args) {
        long[] fixed = {0L, 1L, -1L, 42L, Integer.MIN_VALUE, Integer.MAX_VALUE, 1L << 32,
                Long.MIN_VALUE, Long.MAX_VALUE};
        Random random = new Random(20240601L);
        long[] hashes = new long[fixed.length + 12];
        System.arraycopy(fixed, 0, hashes, 0, fixed.length);
        for (int i = fixed.length; i < hashes.length; i++) {
            hashes[i] = random.nextLong();
        }
        System.out.println("# (key_hash, key group at max_parallelism 128, at 32768, partition of"
                + " the 128-group at n=5)");
        for (long v : hashes) {
            int kg = keyGroup(v, 128);
            System.out.printf("(%d, %d, %d, %d),%n", v, kg, keyGroup(v, 32768), kg * 5 / 128);
        }
        System.out.println("# (key, Kafka murmur2 as a Java int)");
        String[] keys = {"", "a", "ab", "abc", "abcd", "user-42", "21", "kafka-python"};
        for (String key : keys) {
            System.out.printf("(b\"%s\", %d),%n", key,
                    kafkaMurmur2(key.getBytes(StandardCharsets.UTF_8)));
        }
    }
}
