// Apache Curator's InterProcessMutex on a lock path, driven line by line from stdin, so that a
// Leasehold test can show that a Curator client and a Leasehold driver on the same path exclude
// each other. Run with Java's single-file launcher against Debian's Curator jars:
//
//   java -cp <curator, zookeeper, guava, slf4j jars> CuratorMutexProbe.java HOST:PORT /PATH
//
// Commands: "acquire MILLIS" answers "acquired" or "busy"; "release" answers "released";
// "quit" ends. Every answer is one line.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;

public class CuratorMutexProbe {
    public static void main(String[] args) throws Exception {
        CuratorFramework client = CuratorFrameworkFactory.newClient(
            args[0], 5000, 3000, new RetryNTimes(3, 200));
        client.start();
        if (!client.blockUntilConnected(10, TimeUnit.SECONDS)) {
            System.out.println("error: no ZooKeeper connection");
            System.exit(2);
        }
        InterProcessMutex mutex = new InterProcessMutex(client, args[1]);
        System.out.println("ready");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            String[] words = line.trim().split(" ");
            switch (words[0]) {
                case "acquire":
                    boolean got = mutex.acquire(Long.parseLong(words[1]), TimeUnit.MILLISECONDS);
                    System.out.println(got ? "acquired" : "busy");
                    break;
                case "release":
                    mutex.release();
                    System.out.println("released");
                    break;
                case "quit":
                    client.close();
                    return;
                default:
                    System.out.println("error: unknown command " + line);
            }
        }
        client.close();
    }
}
